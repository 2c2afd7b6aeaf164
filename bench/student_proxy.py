"""Benchmark: the MNIST public-cluster student's settings compared on a public proxy.

A student setting is chosen here, never on the test split and never on the training images.
The proxy is the 9,000-image public pool of ``configs/mnist-clusters.yaml`` alone: for each seed
it is split into 7,000 images the student learns on and 2,000 held out, on which it is scored.
The 7,000 carry labels as noisy as a run's pool labels (``--labelled``: the share labelled,
``--wrong``: the share of those flipped to another class; the defaults are the second round's
measured 8,422 of 9,000 labelled, 99.5% right). The rest stay unlabelled, as in a run.

Each arm is the config's student with some settings changed (``ARMS``), trained by the runs' own
path (``Student.train_on``) at one torch thread, ``--workers`` arms at a time. The same seed gives
every arm the same split, labels and initial seeds, so arms are compared seed by seed.

Writes results/bench/student_proxy.json. Nothing private is read: the pool is public, and its
true labels stand in for released ones. No ε is stated.

    python bench/student_proxy.py                          # shipped vs 60 epochs, three seeds (about 13 minutes)
    python bench/student_proxy.py --arms shipped "three members" --seeds 4
    python bench/student_proxy.py --quick                  # a smoke run: 2 epochs, one seed, small pool
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soundness import soundness, timed_on  # noqa: E402

CONFIG = ROOT / "configs" / "mnist-clusters.yaml"
HELD_OUT = 2_000
# Each arm: (FixMatch settings changed, members). "shipped" is the config as it is.
ARMS = {"shipped": ({}, None),
        "60 epochs": ({"epochs": 60}, None),
        "no weights' average": ({"ema_decay": None}, None),
        "three members": ({}, 3)}


def run_arm(arm: str, seed: int, mnist: str, labelled_share: float, wrong_share: float, quick: bool) -> dict:
    """One student of ``arm`` on seed ``seed``'s split of the pool; its held-out accuracy."""
    import numpy as np
    import torch

    from conclave.actors.student import Student
    from conclave.cluster.config import load_yaml
    from conclave.cluster.pipelines import load_pipeline
    from conclave.learning.data import Dataset, make_splits
    from conclave.learning.training import evaluate

    torch.set_num_threads(1)  # --workers students share the machine's cores
    config = load_pipeline(load_yaml(CONFIG)).config
    pool = make_splits("mnist", mnist, public_size=config.data.public_size, seed=config.seed).public
    rng = np.random.default_rng(1000 + seed)
    order = rng.permutation(len(pool.y))
    if quick:
        order = order[:600]
    held = max(len(order) * HELD_OUT // len(pool.y), 1)
    train, test = order[:-held], order[-held:]
    labelled = rng.random(len(train)) < labelled_share
    labels = pool.y[train].copy()
    wrong = labelled & (rng.random(len(train)) < wrong_share)
    labels[wrong] = (labels[wrong] + rng.integers(1, pool.num_classes, wrong.sum())) % pool.num_classes

    changes, members = ARMS[arm]
    settings = dataclasses.replace(config.student.semi_supervised, seed=seed, **changes,
                                   **({"epochs": 2} if quick else {}))
    student = Student(Dataset(pool.x[train], pool.y[train], pool.num_classes, "proxy/learns"),
                      Dataset(pool.x[test], pool.y[test], pool.num_classes, "proxy/held-out"),
                      config.student.model, dataclasses.replace(config.student.train, seed=seed),
                      client_factory=lambda: None, num_threads=1, features=config.data.features,
                      semi_supervised=settings, members=members or config.student.members)
    started = time.perf_counter()
    keep = np.flatnonzero(labelled)
    model, _ = student.train_on(keep, labels[keep])
    return {"arm": arm, "seed": seed, "accuracy": evaluate(model, student.test), "labelled": int(len(keep)),
            "wrong": int(wrong.sum()), "held_out": int(held), "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist", default=str(ROOT.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--arms", nargs="+", default=["shipped", "60 epochs"], choices=list(ARMS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--labelled", type=float, default=8_422 / 9_000, help="share of the 7,000 labelled")
    parser.add_argument("--wrong", type=float, default=0.005, help="share of the labelled ones wrong")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 epochs, one seed, 600 pool images")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "student_proxy.json"))
    args = parser.parse_args()
    seeds = range(1 if args.quick else args.seeds)
    jobs = [(arm, seed) for seed in seeds for arm in args.arms]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_arm, arm, seed, args.mnist, args.labelled, args.wrong, args.quick)
                   for arm, seed in jobs]
        runs = []
        for future in futures:
            runs.append(future.result())
            print(json.dumps(runs[-1]), flush=True)
    by_arm = {arm: [r["accuracy"] for r in runs if r["arm"] == arm] for arm in args.arms}
    base = by_arm[args.arms[0]]
    arms = {arm: {"accuracy_by_seed": accuracies, "mean": statistics.fmean(accuracies),
                  **({} if arm == args.arms[0] else {
                      f"better_than_{args.arms[0]}": sum(a > b for a, b in zip(accuracies, base)),
                      "mean_difference": statistics.fmean(a - b for a, b in zip(accuracies, base))})}
            for arm, accuracies in by_arm.items()}
    result = {"benchmark": "student_proxy", **soundness([]), **timed_on("MNIST's public pool"),
              "releases": "none: the public pool's own labels, made as noisy as a run's, stand in for released ones",
              "config": str(CONFIG.relative_to(ROOT)), "quick": args.quick, "seeds": len(seeds),
              "labelled_share": args.labelled, "wrong_share": args.wrong, "arms": arms, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(arms, indent=2))


if __name__ == "__main__":
    main()
