"""Benchmark: the sparse fine-tuning ablation (Luo et al. 2021, Table 3 and Fig. 3) at CPU scale.

Task: a GroupNorm ResNet-18 at width 1/8 (176k parameters) pre-trained without privacy on
MNIST digits 0–4 (public), then DP-fine-tuned on digits 5–9 (private) with a new 5-way
classifier, evaluated on the MNIST test digits 5–9. Images are 2×2 average-pooled to 14×14
and the private set is a seeded subsample, so that the whole benchmark takes about ten
minutes on 2 shared CPU cores.

Measured: the four variants (classifier; + norm; + norm + masked conv = "all"; whole
network) at ε ∈ {0.5, 1.0, 1.5} (δ = 1e-5, σ calibrated per ε by Opacus's RDP accountant);
the mask fraction p ∈ {0.1, 1, 10}% for "all" at ε = 1.0; and the noise-to-gradient ratio
per layer group of each variant's first DP-SGD step (Fig. 3), on one batch of the public
test images (digits 5–9) through the public model, so no private gradient is measured.

DP-SGD noise and Poisson sampling come from OS entropy (``privacy.noise.SECURE``); the seed
only fixes the splits, the initialisation and the public pre-training. Each run's ε is its
own model's guarantee; all runs fine-tune on the same private set, so ``guarantee_all_runs``
composes their schedules (fixed before training). Of the private fine-tunings only the DP
models' test accuracy is recorded: no loss, and no per-run time (a Poisson-sampled run's
time moves with the private data), only the whole benchmark's wall time.

    python bench/sparse_finetune.py [--quick]      → results/bench/sparse_finetune.json
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores, thread_settings  # noqa: E402  (before torch loads)

share_cores()
import torch  # noqa: E402

from conclave.cluster.api import PretrainConfig, pretrain_public  # noqa: E402
from conclave.learning.data import Dataset  # noqa: E402
from conclave.learning.dp_schedule import DPSGDConfig, dp_schedule
from conclave.learning.dpsgd import train_dp  # noqa: E402
from conclave.learning.models import build_model  # noqa: E402
from conclave.learning.sparse import (  # noqa: E402
    VARIANTS, noise_to_gradient_ratio, plan_variant, replace_classifier, transfer_split,
)
from conclave.learning.training import evaluate  # noqa: E402
from conclave.privacy.accounting.guarantee import worst_case_guarantee  # noqa: E402
from conclave.privacy.accounting.rdp import sum_charges  # noqa: E402
from conclave.privacy.noise import SECURE  # noqa: E402

from bench.soundness import soundness, timed_on  # noqa: E402

MNIST = ROOT.parent / "shared" / "data" / "mnist"
OUTPUT = ROOT / "results" / "bench" / "sparse_finetune.json"
NOISE = SECURE  # DP-SGD noise and Poisson sampling: OS entropy

# Luo et al. 2021, Table 3 (CIFAR-100 → CIFAR-10, ResNet-18, p = 1%). The middle row is
# labelled "Cls+conv" in the table but described as classifier + normalisation in its caption.
PAPER = {
    "epsilons": [0.5, 1.0, 1.5],
    "classifier": [70.68, 71.28, 71.20],
    "classifier+norm": [73.70, 72.78, 76.21],
    "all": [73.28, 76.64, 81.57],
}


def pooled(data: Dataset) -> Dataset:
    """28×28 → 14×14 by 2×2 averaging (a quarter of the convolution cost)."""
    n, c, h, w = data.x.shape
    x = data.x.reshape(n, c, h // 2, 2, w // 2, 2).mean(axis=(3, 5))
    return Dataset(np.ascontiguousarray(x, dtype=np.float32), data.y, data.num_classes, f"{data.name}@14x14")


def finetune(public_model, private: Dataset, test: Dataset, variant: str, fraction: float, config: DPSGDConfig) -> dict:
    """One DP fine-tuning; what it records of the private data is the DP model's test accuracy."""
    model = replace_classifier(copy.deepcopy(public_model), private.num_classes, seed=0)
    plan = plan_variant(model, variant, fraction)
    result = train_dp(model, private, config, NOISE.source(f"dpsgd-sparse-{variant}"), masks=plan.masks)
    accuracy = evaluate(result.model, test)
    logging.info("%-16s p=%-6g ε=%.3f σ=%.2f acc=%.4f", variant, fraction, result.epsilon,
                 result.noise_multiplier, accuracy)
    return {
        "variant": variant, "fraction": fraction, "accuracy": accuracy, "epsilon": result.epsilon,
        "target_epsilon": config.target_epsilon, "noise_multiplier": result.noise_multiplier,
        "steps": result.steps, "trained_entries": plan.trained_entries,
        "trained_fraction": plan.trained_fraction,
    }


def ratios(public_model, public: Dataset, batch: int, sigma: float, fraction: float) -> dict:
    """Noise-to-gradient ratio per group at the first step of each variant (Fig. 3), on the
    first ``batch`` examples of ``public`` (public images of the private task's classes)."""
    x, y = torch.from_numpy(public.x[:batch]), torch.from_numpy(public.y[:batch])
    out: dict = {}
    for variant in VARIANTS:
        model = replace_classifier(copy.deepcopy(public_model), public.num_classes, seed=0)
        plan = plan_variant(model, variant, fraction)
        measured = noise_to_gradient_ratio(model, x, y, sigma, 1.0, plan.masks)
        out[variant] = measured["groups"]
        if variant == "whole":
            layers = measured["layers"]
    return {"groups": out, "layers_whole": layers}


def summarize(setting: dict, runs: list[dict], planned: int, sigma: float, noise_ratio: dict, guarantee: dict) -> dict:
    """The JSON payload from the runs finished so far (missing cells are null)."""

    def accuracy(variant: str, epsilon: float, fraction: float) -> float | None:
        return next((r["accuracy"] for r in runs if r["variant"] == variant and r["target_epsilon"] == epsilon
                     and r["fraction"] == fraction), None)

    table = {v: [accuracy(v, e, setting["main_fraction"]) for e in setting["epsilons"]] for v in VARIANTS}
    pairs = [(a, c) for a, c in zip(table["all"], table["classifier"]) if a is not None and c is not None]
    gaps = [a - c for a, c in pairs]
    return {
        "benchmark": "sparse_finetune", **soundness(guarantee["unsound_reasons"]),
        **timed_on("MNIST, digits 5-9 in the private role"), "setting": setting,
        "thread_settings": thread_settings(), "complete": len(runs) == planned, "guarantee_all_runs": guarantee,
        "paper_table3_cifar10": PAPER, "accuracy_by_variant": table,
        "direction": {
            "all_minus_classifier": gaps,
            "all_beats_classifier_at_every_epsilon": all(g > 0 for g in gaps) if gaps else None,
            "gap_grows_with_epsilon": all(b > a for a, b in zip(gaps, gaps[1:])) if len(gaps) > 1 else None,
            "whole_minus_all": [w - a for w, a in zip(table["whole"], table["all"]) if w is not None and a is not None],
        },
        "fraction_sweep_at_epsilon_1": {str(f): accuracy("all", 1.0, f) for f in setting["fractions"]},
        "noise_to_gradient_ratio_at_epsilon_1": {
            "noise_multiplier": sigma, "batch": setting["batch_size"],
            "measured_on": "the first images of the public MNIST test digits 5-9, through the public model "
                           "with the new classifier (no private gradient)", **noise_ratio},
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (one ε, 1,000 private examples)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = parser.parse_args()
    # No timestamps: two runs' lines would time the private fine-tuning between them.
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    warnings.filterwarnings("ignore", module="opacus")
    warnings.filterwarnings("ignore", message=".*backward hook.*")
    logging.getLogger("conclave.learning.dpsgd").setLevel(logging.WARNING)  # one line per run is enough
    torch.set_num_threads(args.threads)

    setting = {
        "model": "gn_resnet18", "width": 0.125, "image": "MNIST 2x2-average-pooled to 14x14",
        "public": "MNIST train digits 0-4, 10,000 examples", "private_size": 1000 if args.quick else 5000,
        "pretrain_epochs": 2, "dp_epochs": 2 if args.quick else 5, "batch_size": 250 if args.quick else 500,
        "lr": 0.1, "classifier_lr": 2.0, "momentum": 0.9, "max_grad_norm": 1.0, "delta": 1e-5,
        "epsilons": [1.0] if args.quick else [0.5, 1.0, 1.5], "fractions": [0.001, 0.01, 0.1],
        "main_fraction": 0.01, "quick": args.quick,
    }
    public_train, public_test = transfer_split("mnist", str(MNIST), (0, 1, 2, 3, 4), 10_000, seed=0)
    private, test = transfer_split("mnist", str(MNIST), (5, 6, 7, 8, 9), setting["private_size"], seed=0)
    public_train, public_test, private, test = pooled(public_train), pooled(public_test), pooled(private), pooled(test)

    started = time.perf_counter()
    public_model = build_model("gn_resnet18", 5, 1, seed=0, width=setting["width"])
    # No checkpoint: a resumed pre-training would record no time.
    pretrain_public(public_model, public_train, PretrainConfig(epochs=setting["pretrain_epochs"], batch_size=128),
                    seed=0, checkpoint_dir=None, progress=False)
    pretrain_seconds = time.perf_counter() - started
    public_accuracy = evaluate(public_model, public_test)
    logging.info("public model: %.4f on %s", public_accuracy, public_test.name)

    def dp(epsilon: float) -> DPSGDConfig:
        return DPSGDConfig(epochs=setting["dp_epochs"], batch_size=setting["batch_size"], lr=setting["lr"],
                           max_grad_norm=1.0, delta=1e-5, target_epsilon=epsilon, momentum=0.9,
                           lr_overrides=(("classifier.", setting["classifier_lr"]),))

    sigma = dp_schedule(len(private), dp(1.0)).noise_multiplier
    noise_ratio = ratios(public_model, test, setting["batch_size"], sigma, setting["main_fraction"])
    plan = [(e, v, setting["main_fraction"]) for e in setting["epsilons"] for v in VARIANTS]
    plan += [(1.0, "all", f) for f in setting["fractions"] if f != setting["main_fraction"]]
    # Every run fine-tunes on the same private set: the benchmark's guarantee composes them all.
    planned = sum_charges([dp_schedule(len(private), dp(e), label=f"dpsgd-sparse-{v}-p{f:g}-eps{e:g}").charge
                           for e, v, f in plan], label="sparse_finetune")
    guarantee = worst_case_guarantee(planned, setting["delta"]).marked((NOISE.unsound_reason,)).as_dict()
    runs: list[dict] = []
    for epsilon, variant, fraction in plan:
        runs.append(finetune(public_model, private, test, variant, fraction, dp(epsilon)))
        # Written after every run, so a slow machine still leaves the finished part.
        payload = summarize(setting, runs, len(plan), sigma, noise_ratio, guarantee)
        payload.update(public_test_accuracy=public_accuracy, pretrain_seconds=pretrain_seconds,
                       total_seconds=time.perf_counter() - started,
                       machine={"python": platform.python_version(), "torch": torch.__version__,
                                "threads": args.threads})
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
    table, gaps = payload["accuracy_by_variant"], payload["direction"]["all_minus_classifier"]
    print(f"sparse_finetune: acc all {['%.3f' % a for a in table['all']]} vs classifier "
          f"{['%.3f' % a for a in table['classifier']]} vs whole {['%.3f' % a for a in table['whole']]} "
          f"at ε={setting['epsilons']}; all−classifier gap {['%+.3f' % g for g in gaps]}; "
          f"all runs together ε={guarantee['epsilon']:.3g}; {payload['total_seconds']:.0f} s → {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
