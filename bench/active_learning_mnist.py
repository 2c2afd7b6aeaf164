"""Benchmark: private active learning on real MNIST (Zhao et al. 2019, Fig. 1, at CPU scale).

Private = a seeded part of the MNIST training set (DP-SGD, ε ≈ 3, δ = 1e-5); public pool = the
disjoint rest of the training set with labels hidden until bought; test = the MNIST test set.
Every strategy fine-tunes the same final DP checkpoint for each N_labeled; NearPrivate starts
from the latest earlier checkpoint whose composed ε (DP-SGD ⊕ DP-PCA ⊕ noisy counts) does not
exceed the final checkpoint's, so all compared models carry the same guarantee.
A second run reuses those checkpoints on a polluted public pool (+20% out-of-domain images:
inverted digits, uniform noise, random strokes) and reports the share of out-of-domain picks.

Writes results/bench/active_learning_mnist.json after each run (an interrupted benchmark keeps
what it measured; "quick", "full" and their "_secure" figures sit side by side in it; ``sound`` at the top is
false when any run's, of either, is) and the run folders under results/bench/active_learning_mnist/.

    python bench/active_learning_mnist.py            # configs/mnist-active.yaml as shipped
    python bench/active_learning_mnist.py --quick    # smaller private set, fewer epochs and budgets
    python bench/active_learning_mnist.py --secure   # one shard actor per shard, summed securely (clean pool)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores, thread_settings  # noqa: E402  (before torch loads)

share_cores()

from conclave.cluster.api import (  # noqa: E402
    ActiveLearning, ActiveLearningConfig, RunContext, RunDirectory, load_pipeline, load_yaml,
)

from bench.soundness import run_reasons, soundness, timed_on  # noqa: E402

log = logging.getLogger("bench.active_learning_mnist")

MODES = ("full", "quick", "full_secure", "quick_secure")
POLLUTION = 0.2  # as the paper's SVHN test: 10k CIFAR images in a 50k pool

SEED_REFERENCE = {
    "source": "Zhao et al. 2019 (ICLR 2020 submission), §4.1 and Fig. 1; public = 50k QMNIST, private = 60k MNIST",
    "dp_baseline": {"accuracy": 0.973, "epsilon": 3.0},
    "checkpoint_1": {"accuracy": 0.975, "epsilon": 3.2},
    "checkpoint_0": {"accuracy": 0.970, "epsilon": 2.2},
    "diverse_public_7000": {"accuracy": 0.988, "epsilon": 3.2},
    "near_private": "from checkpoint 0 (ε 2.2) + 1.0 for selection: catches up with DiversePublic after "
                    "~2,000 labels and is best beyond",
    "pollution": "SVHN + 10k CIFAR: NearPrivate beats DiversePublic by > 2 points",
    "tf_privacy_tutorial": {"accuracy": 0.966, "epsilon": 3.0},
}


def bench_config(mnist: Path, quick: bool, secure: bool) -> ActiveLearningConfig:
    config = load_pipeline(load_yaml(ROOT / "configs" / "mnist-active.yaml")).config
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, root=str(mnist)))
    if quick:
        config = dataclasses.replace(
            config, name="mnist-active-quick",
            data=dataclasses.replace(config.data, private_size=20000, public_size=10000),
            dpsgd=dataclasses.replace(config.dpsgd, epochs=8),
            selection=dataclasses.replace(config.selection, sizes=(1000, 2000)),
            finetune=dataclasses.replace(config.finetune, epochs=5),
        )
    if secure:
        # One shard actor per shard, as two owners would hold them: DP-SGD's clipped sums and
        # NearPrivate's sums meet only in the secure sum with distributed Skellam noise.
        config = dataclasses.replace(config, name=f"{config.name}-secure",
                                     dpsgd=dataclasses.replace(config.dpsgd, distributed=True))
    return config


def table(metrics: dict) -> dict:
    """accuracy / ε / out-of-domain share per strategy per N_labeled."""
    out: dict = {}
    for row in metrics["results"]:
        out.setdefault(row["strategy"], {})[str(row["n_labeled"])] = {
            "accuracy": round(row["accuracy"], 4), "epsilon": round(row["epsilon"], 3),
            "out_of_domain_share": round(row["out_of_domain_share"], 4), "start_epoch": row["start_epoch"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (minutes, not tens of minutes)")
    parser.add_argument("--secure", action="store_true",
                        help="one shard actor per shard, summed through the secure sum (clean pool only)")
    parser.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "active_learning_mnist.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    config = bench_config(args.mnist, args.quick, args.secure)
    runs_dir = args.out.parent / "active_learning_mnist"
    mode = ("quick" if args.quick else "full") + ("_secure" if args.secure else "")
    report: dict = {"config": dataclasses.asdict(config), "thread_settings": thread_settings(), "runs": {},
                    "finished": False}
    # One file for every mode: a quick run does not erase the full run's figures, nor vice versa.
    everything = json.loads(args.out.read_text()) if args.out.exists() else {}
    everything.update({"seed_reference": SEED_REFERENCE, mode: report})

    def save() -> None:
        runs = {f"{kind}/{name}": run for kind in MODES if kind in everything
                for name, run in everything[kind]["runs"].items()}
        everything.update(soundness(run_reasons(runs)))
        everything.update(timed_on("MNIST, its training split in the private role"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(everything, indent=2, sort_keys=True, default=str) + "\n")

    polluted = dataclasses.replace(
        config, name=f"{config.name}-polluted", checkpoints_from=str(runs_dir / config.name),
        data=dataclasses.replace(config.data, pollution=POLLUTION))
    # A rerun of the benchmark is a fresh measurement: its run folders (and ledgers) start empty, and
    # so do the records this machine keeps of those ledgers (``$CONCLAVE_HOME/ledgers``), kept here.
    home = runs_dir / f"{config.name}.conclave-home"
    for folder in (config.name, polluted.name, home.name):
        shutil.rmtree(runs_dir / folder, ignore_errors=True)
    os.environ["CONCLAVE_HOME"] = str(home)
    # The pollution run reuses the clean run's checkpoints: it says nothing new about the sums.
    runs = (("clean", config),) if args.secure else (("clean", config), ("polluted", polluted))
    for key, run_config in runs:
        log.info("run %s (%s)", key, run_config.name)
        started = time.perf_counter()
        outcome = ActiveLearning(run_config).run(RunContext(run_config.name, RunDirectory(runs_dir, run_config.name)))
        summary, metrics, privacy = outcome.summary, outcome.metrics, outcome.privacy.as_dict()
        report["runs"][key] = {
            "seconds": round(time.perf_counter() - started, 1), "summary": summary,
            "dp_checkpoints": [{k: c[k] for k in ("epoch", "epsilon", "test_accuracy")} for c in metrics["checkpoints"]],
            "public_pool": metrics["public_pool"], "out_of_domain": metrics["out_of_domain"],
            "table": table(metrics), "near_private": privacy.get("near_private"),
            "guarantee": privacy["guarantee"], "sound": privacy["sound"],
            "unsound_reasons": privacy["unsound_reasons"], "spent": privacy["spent"]}
        save()

    report["finished"] = True
    save()
    clean = report["runs"]["clean"]
    final = clean["dp_checkpoints"][-1]
    top = str(max(config.selection.sizes))
    best = {name: cells[top]["accuracy"] for name, cells in clean["table"].items()}
    polluted_run = report["runs"].get("polluted")
    shares = {} if polluted_run is None else {
        name: cells[top]["out_of_domain_share"] for name, cells in polluted_run["table"].items()}
    print(f"active_learning_mnist ({mode}): DP checkpoint {final['test_accuracy']:.4f} "
          f"at ε={final['epsilon']:.2f}; at N={top}: "
          + ", ".join(f"{k} {v:.4f}" for k, v in best.items())
          + ("; polluted pool, out-of-domain share: " + ", ".join(f"{k} {v:.2f}" for k, v in shares.items())
             if shares else "")
          + f"; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
