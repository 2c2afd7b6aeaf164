"""Benchmark: how many teachers the sound stability mechanism needs on MNIST at ε = 1.

The stability mechanism (privacy/mechanisms/stability.py: Bassily et al. 2018, calibrated as
Lyu, Su & Li 2017 Alg. 1, δ = 1e-5) releases the exact plurality only where the distance to
instability clears a noisy threshold, and stops after c abstentions. For ensembles of n
teachers it measures the share of Q = 1,000 MNIST test queries answered (in order, the best
c of a grid, mean of several runs) and the accuracy of the answers, two ways:

* **MNIST as it is** — the 60,000 training images hashed into n shards (the product's
  sharding), each teacher a 1-nearest-neighbour classifier on 40 PCA components fitted on
  the public half of the test set. 1-NN is the cheapest teacher there is (the cost of all n
  is one distance matrix, whatever n), so thousands of teachers fit on 2 cores; teachers get
  weaker as n grows because each holds 60,000/n images.
* **idealised** — n teachers each as good as a member of the 250-teacher ensemble above:
  per query, n votes drawn from the 250 teachers' vote shares. It needs 240·n images: an
  optimistic bound on what more data would buy.

Writes results/bench/stability_ensemble_size.json and prints the smallest n reaching a 50%
and a 90% answer rate each way (None: not reached on the grid). A study of the mechanism on
public data, not a release: the file is marked unsound (``UNSOUND_REASONS``).

    python bench/stability_ensemble_size.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores, thread_settings  # noqa: E402  (before torch loads)

share_cores()

from conclave.learning.data import Dataset, load_mnist  # noqa: E402
from conclave.learning.data.dataset import record_hashes  # noqa: E402
from conclave.privacy.mechanisms import ABSTAIN, Stability  # noqa: E402
from conclave.privacy.noise import SECURE  # noqa: E402

from bench.soundness import soundness, timed_on  # noqa: E402

log = logging.getLogger("bench.stability_ensemble_size")

EPSILON, DELTA = 1.0, 1e-5
CAPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
ENSEMBLES = (250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000)
REAL_LIMIT = 8000  # beyond this a 1-NN teacher holds < 8 images: the real-data curve stops there
UNSOUND_REASONS = (
    "plurality_accuracy and mean_plurality_share are read from the teachers' votes without a mechanism",
    "each answer rate is a mean over repeated runs of the mechanism at every cap c, the best c kept: each run "
    "is (epsilon, delta)-DP, the figures together are not one release at that epsilon",
)


def pca_features(train: Dataset, public: Dataset, queries: Dataset, components: int = 40):
    """Project everything on the top principal components of the public images only."""
    flat = public.x.reshape(len(public), -1).astype(np.float64)
    mean = flat.mean(axis=0)
    _, _, vt = np.linalg.svd(flat - mean, full_matrices=False)
    basis = vt[:components].T

    def project(data: Dataset) -> np.ndarray:
        return ((data.x.reshape(len(data), -1) - mean) @ basis).astype(np.float32)

    return project(train), project(queries)


def nearest_order(train_features: np.ndarray, query_features: np.ndarray) -> np.ndarray:
    """[queries, train] indices of the training images by distance to each query (int32)."""
    squared = (query_features**2).sum(axis=1)[:, None] - 2 * query_features @ train_features.T \
        + (train_features**2).sum(axis=1)[None, :]
    return np.argsort(squared, axis=1).astype(np.int32)


def one_nn_votes(order: np.ndarray, labels: np.ndarray, shard_of: np.ndarray, n: int, classes: int) -> np.ndarray:
    """Votes of n 1-NN teachers: each votes the label of its own nearest training image."""
    votes = np.zeros((len(order), classes), dtype=np.int64)
    for q, ranked in enumerate(order):
        _, first = np.unique(shard_of[ranked], return_index=True)
        np.add.at(votes[q], labels[ranked[first]], 1)
    return votes


def idealised_votes(shares: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n teachers per query drawn i.i.d. from the base ensemble's vote shares."""
    return np.stack([rng.multinomial(n, p) for p in shares]).astype(np.int64)


def answer_rate(votes: np.ndarray, truth: np.ndarray, runs: int) -> dict:
    """The best c of ``CAPS``: mean share answered (over ``runs``) and accuracy of the answers."""
    best = {"answered": 0.0, "cap": None, "accuracy": None}
    for cap in CAPS:
        answered, correct = 0, 0
        for _ in range(runs):
            mechanism = Stability(EPSILON, DELTA, cap)
            result = mechanism(votes, SECURE.source("bench").rng)
            mask = result.labels != ABSTAIN
            answered += int(mask.sum())
            correct += int((result.labels[mask] == truth[mask]).sum())
        share = answered / (runs * len(votes))
        if share > best["answered"]:
            best = {"answered": share, "cap": cap, "accuracy": correct / answered if answered else None,
                    "threshold": Stability(EPSILON, DELTA, cap).calibration.threshold}
    return best


def smallest(rows: list[dict], share: float) -> int | None:
    return next((r["teachers"] for r in rows if r["answered"] >= share), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 queries, fewer ensembles and runs")
    parser.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "stability_ensemble_size.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.perf_counter()
    queries_count, runs = (300, 2) if args.quick else (1000, 5)
    ensembles = ENSEMBLES[:4] if args.quick else ENSEMBLES

    train, test = load_mnist(args.mnist)
    order_of_test = np.random.default_rng(0).permutation(len(test))
    queries = test.subset(order_of_test[:queries_count], "mnist/queries")
    public = test.subset(order_of_test[5000:], "mnist/public-for-pca")  # disjoint from the queries
    train_features, query_features = pca_features(train, public, queries)
    order = nearest_order(train_features, query_features)
    log.info("distances ready (%.0f s)", time.perf_counter() - started)

    real, idealised, base_shares = [], [], None
    for n in ensembles:
        if n <= REAL_LIMIT:
            shard_of = (record_hashes(train, 0) % np.uint64(n)).astype(np.int64)
            votes = one_nn_votes(order, train.y, shard_of, n, 10)
            teacher_accuracy = float(np.mean([(np.argmax(v) == t) for v, t in zip(votes, queries.y)]))
            row = {"teachers": n, "images_per_teacher": len(train) / n,
                   "plurality_accuracy": teacher_accuracy,
                   "mean_plurality_share": float((votes.max(axis=1) / n).mean()),
                   **answer_rate(votes, queries.y, runs)}
            real.append(row)
            log.info("MNIST as is, n=%d: answered %.3f (c=%s)", n, row["answered"], row["cap"])
            if n == ensembles[0]:
                base_shares = votes / votes.sum(axis=1, keepdims=True)
        votes = idealised_votes(base_shares, n, np.random.default_rng(n))
        row = {"teachers": n, "images_needed": 240 * n, **answer_rate(votes, queries.y, runs)}
        idealised.append(row)
        log.info("idealised, n=%d: answered %.3f (c=%s)", n, row["answered"], row["cap"])

    out = {
        "benchmark": "stability_ensemble_size", **soundness([*UNSOUND_REASONS, SECURE.unsound_reason]),
        **timed_on("MNIST"),
        "quick": args.quick, "thread_settings": thread_settings(), "epsilon": EPSILON, "delta": DELTA,
        "queries": queries_count, "runs_per_cap": runs, "caps": CAPS,
        "teachers_model": "1-nearest-neighbour on 40 PCA components fitted on public MNIST test images",
        "mnist_as_is": real, "idealised_250_teacher_quality": idealised,
        "smallest_ensemble": {
            "mnist_as_is": {"answers_50_percent": smallest(real, 0.5), "answers_90_percent": smallest(real, 0.9)},
            "idealised": {"answers_50_percent": smallest(idealised, 0.5), "answers_90_percent": smallest(idealised, 0.9)},
        },
        "seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    s = out["smallest_ensemble"]
    print(f"stability_ensemble_size{' (quick)' if args.quick else ''}: at ε={EPSILON}, smallest ensemble answering "
          f"≥50% / ≥90% of MNIST queries: as is {s['mnist_as_is']['answers_50_percent']} / "
          f"{s['mnist_as_is']['answers_90_percent']}, idealised {s['idealised']['answers_50_percent']} / "
          f"{s['idealised']['answers_90_percent']} teachers; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
