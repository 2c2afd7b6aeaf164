"""Benchmark: the MNIST public-cluster student's settings compared on a public proxy.

A student or labelling setting is chosen here, never on the test split and never on the training
images. The proxy is the 9,000-image public pool of ``configs/mnist-clusters.yaml`` alone: for each
seed it is split into 7,000 images the student learns on and 2,000 held out, on which it is scored.
The 7,000 get their labels in one of two ways (each arm says which):

* ``random``: the true labels, as noisy as a run's pool labels (``--labelled``: the share
  labelled, ``--wrong``: the share of those flipped to another class; the defaults are the second
  round's measured 8,422 of 9,000 labelled, 99.5% right), gaps and errors placed at random;
* ``round 1`` / ``round 2``: a simulated public-cluster release with a run's structure. The 7,000
  are clustered in the round's embedding (HOG-PCA; round 2: the first round's student network,
  ``--runs``), the clusters' count scaled to keep a run's images per cluster; the 7,000 vote as the
  records, each for its 3 nearest medoids but never for itself; the histogram gets Gaussian noise
  with σ scaled so that a medoid's votes stand to the noise as a run's 60,000 records' do to σ 40;
  answers need a noised top count of ``threshold`` σ; the pool takes its labels from the
  answered medoids as a run does (``PoolClusters.spread``). Gaps and errors fall where a run's do:
  on the pool's hardest images.

Each arm is the config's student with some settings changed (``ARMS``), trained by the runs' own
path (``StudentTrainer.train_on``) at one torch thread, ``--workers`` arms at a time. The same seed gives
every arm the same split, labels (of its kind) and initial seeds, so arms are compared seed by seed.

Writes results/bench/student_proxy.json. Nothing private is read: the pool is public, and its
true labels stand in for released ones. No ε is stated; the simulated releases draw numpy noise
from a seed, so a file with cluster arms says ``sound: false``.

    python bench/student_proxy.py                          # shipped vs 60 epochs, three seeds (about 13 minutes)
    python bench/student_proxy.py --arms shipped "three members" --seeds 4
    python bench/student_proxy.py --arms shipped ReLU --out results/bench/student_proxy_relu.json
    python bench/student_proxy.py --arms "round 2" "round 2, threshold 3σ"
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soundness import soundness, timed_on  # noqa: E402
from conclave.cluster.api import TeacherStudentConfig, load_pipeline, load_yaml  # noqa: E402

CONFIG = ROOT / "configs" / "mnist-clusters.yaml"
HELD_OUT = 2_000
PRIVATE_RECORDS = 60_000  # MNIST's training images: the records a run's medoids are voted for by
SIMULATED = ("simulated public-cluster releases: numpy Gaussian noise from a seed stands in for a run's "
             "OS-entropy noise, and the pool's own images stand in for the private records")


@dataclass(frozen=True)
class Arm:
    """The config's student (or ``model``) with ``fixmatch`` settings changed and ``members``
    students averaged (None: the config's), learning on ``labels`` (``LABELS``) released at ``sigma`` (None: the
    config's), answered at ``threshold`` σ and spread at ``margin`` (None: the config's).
    ``votes_per_record``: each record's votes m (None: the config's; ``sigma`` is then the run's σ at that m);
    ``clusters``: a run's count of clusters (None: the config's); ``test_views``: the student's
    test predictions averaged over that many weak views too (``learning.view_averaging``).
    ``oracle``, a diagnosis and no setting: ``"gaps"`` gives the images the release left unlabelled
    their true labels, ``"errors"`` corrects its wrong labels (what each part of its gaps and errors costs)."""

    fixmatch: dict[str, Any] = field(default_factory=dict)
    members: int | None = None
    labels: str = "random"
    sigma: float | None = None
    threshold: float = 0.0
    margin: float | None = None
    oracle: str | None = None
    model: str | None = None
    votes_per_record: int | None = None
    clusters: int | None = None
    test_views: int = 0


LABELS = {"random": None, "round 1": "hog-pca", "round 2": "network:{runs}/mnist-clusters/student.pt",
          "ReLU round 2": "network:{runs}/mnist-clusters-relu-eps01-r1/student.pt"}
RELU = "scatternet_cnn_wide_relu"
ARMS = {"shipped": Arm(),
        "60 epochs": Arm({"epochs": 60}),
        "no weights' average": Arm({"ema_decay": None}),
        "three members": Arm(members=3),
        "ReLU": Arm(model="scatternet_cnn_wide_relu"),
        "round 1": Arm(labels="round 1"),
        "round 2": Arm(labels="round 2"),
        "round 2, threshold 3σ": Arm(labels="round 2", threshold=3.0),
        "round 2, margin 0.3": Arm(labels="round 2", margin=0.3),
        "round 2, σ 23": Arm(labels="round 2", sigma=23.0),
        "round 2, gaps given true labels (oracle)": Arm(labels="round 2", oracle="gaps"),
        "round 2, wrong labels corrected (oracle)": Arm(labels="round 2", oracle="errors"),
        # the ε 0.1 cell's second round (σ 78, in the ReLU round 1's network), and other spreads of it:
        # fewer gaps for more errors, or the reverse; m 12 at σ 156 costs as m 3 at σ 78
        "ReLU round 2, σ 78": Arm(labels="ReLU round 2", sigma=78.0, model=RELU),
        "ReLU round 2, σ 78, margin 0.3": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, margin=0.3),
        "ReLU round 2, m 12 at σ 156, margin 0.3": Arm(labels="ReLU round 2", sigma=156.0, model=RELU, margin=0.3,
                                                        votes_per_record=12),
        "ReLU round 2, σ 78, 300 clusters": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, clusters=300),
        "ReLU round 2, σ 78, margin 0.6": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, margin=0.6),
        "ReLU round 2, σ 78, margin 0.7": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, margin=0.7),
        # more augmented copies of each image to learn from (the shipped 4 are computed once each)
        "ReLU round 2, σ 78, 8 views": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, fixmatch={"views": 8}),
        "ReLU round 2, σ 78, 16 views": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, fixmatch={"views": 16}),
        "ReLU round 2, σ 78, 8 test views": Arm(labels="ReLU round 2", sigma=78.0, model=RELU, test_views=8)}


def random_labels(truth: np.ndarray, labelled_share: float, wrong_share: float, num_classes: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(indices labelled, their labels): ``truth`` with gaps and errors placed at random."""
    labelled = rng.random(len(truth)) < labelled_share
    labels = truth.copy()
    wrong = labelled & (rng.random(len(truth)) < wrong_share)
    labels[wrong] = (labels[wrong] + rng.integers(1, num_classes, wrong.sum())) % num_classes
    keep = np.flatnonzero(labelled)
    return keep, labels[keep]


def cluster_labels(x: np.ndarray, truth: np.ndarray, config: TeacherStudentConfig, embedding: str, arm: Arm,
                   seed: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(indices labelled, their labels): a simulated public-cluster release over ``x`` (module
    docstring), ``x``'s own images voting with ``truth``, as ``arm`` sets it."""
    from conclave.learning.embeddings import fit_embedding
    from conclave.learning.selection.clusters import cluster_pool
    from conclave.privacy.exact_distances import nearest_queries
    from conclave.privacy.mechanisms.public_clusters import cluster_answers

    clusters, selection = config.clusters, config.student.selection
    embedded = np.asarray(fit_embedding(embedding, x, clusters.dims)(x), dtype=np.float64)
    run_count = arm.clusters or clusters.count
    count = round(run_count * len(x) / config.data.public_size)
    pool = cluster_pool(embedded, count, seed)
    medoids = embedded[pool.medoids]
    votes = np.zeros((count, int(truth.max()) + 1))
    m = arm.votes_per_record or clusters.votes_per_record
    nearest = nearest_queries(embedded, medoids, m + 1)
    own = np.full(len(x), -1)
    own[pool.medoids] = np.arange(count)
    # a medoid never votes for itself: its own column moves last, then the first m are kept
    order = np.argsort(nearest == own[:, None], axis=1, kind="stable")[:, :m]
    np.add.at(votes, (np.take_along_axis(nearest, order, axis=1), truth[:, None]), 1)
    # the same votes per medoid against the noise as a run's records have against its σ
    sigma = (arm.sigma or config.mechanism.params["sigma"]) * (len(x) / count) / (PRIVATE_RECORDS / run_count)
    answers = cluster_answers(votes + rng.normal(0.0, sigma, votes.shape), arm.threshold * sigma, 0.0)
    margin = selection.spread_margin if arm.margin is None else arm.margin
    spread = pool.spread({int(m): int(a) for m, a in zip(pool.medoids, answers) if a >= 0},
                         selection.spread_medoids, selection.spread_decay, margin)
    keep, labels = np.fromiter(spread, dtype=np.int64), np.fromiter(spread.values(), dtype=np.int64)
    if arm.oracle == "errors":
        return keep, truth[keep]
    if arm.oracle == "gaps":
        gaps = np.setdiff1d(np.arange(len(x)), keep)
        return np.concatenate([keep, gaps]), np.concatenate([labels, truth[gaps]])
    return keep, labels


def run_arm(name: str, seed: int, mnist: str, runs: str, labelled_share: float, wrong_share: float,
            quick: bool) -> dict:
    """One student of arm ``name`` on seed ``seed``'s split of the pool; its held-out accuracy."""
    import torch

    from conclave.learning.data import Dataset, make_splits
    from conclave.learning.student_training import StudentTrainer

    torch.set_num_threads(1)  # --workers students share the machine's cores
    arm = ARMS[name]
    config = load_pipeline(load_yaml(CONFIG)).config
    pool = make_splits("mnist", mnist, public_size=config.data.public_size, seed=config.seed).public
    rng = np.random.default_rng(1000 + seed)
    order = rng.permutation(len(pool.y))
    if quick:
        order = order[:1_800]
    held = max(len(order) * HELD_OUT // len(pool.y), 1)
    train, test = order[:-held], order[-held:]
    if arm.labels == "random":
        keep, labels = random_labels(pool.y[train], labelled_share, wrong_share, pool.num_classes, rng)
    else:
        keep, labels = cluster_labels(pool.x[train], pool.y[train], config, LABELS[arm.labels].format(runs=runs),
                                      arm, seed, rng)

    settings = dataclasses.replace(config.student.semi_supervised, seed=seed, **arm.fixmatch,
                                   **({"epochs": 2} if quick else {}))
    student = StudentTrainer(Dataset(pool.x[train], pool.y[train], pool.num_classes, "proxy/learns"),
                             Dataset(pool.x[test], pool.y[test], pool.num_classes, "proxy/held-out"),
                             arm.model or config.student.model, dataclasses.replace(config.student.train, seed=seed),
                             features=config.data.features, semi_supervised=settings,
                             members=arm.members or config.student.members, test_views=arm.test_views)
    started = time.perf_counter()
    model, _ = student.train_on(keep, labels)
    return {"arm": name, "seed": seed, "accuracy": student.accuracy(model), "labelled": int(len(keep)),
            "wrong": int((labels != pool.y[train][keep]).sum()), "held_out": int(held),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist", default=str(ROOT.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--arms", nargs="+", default=["shipped", "60 epochs"], choices=list(ARMS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--labelled", type=float, default=8_422 / 9_000, help="share of the 7,000 labelled")
    parser.add_argument("--wrong", type=float, default=0.005, help="share of the labelled ones wrong")
    parser.add_argument("--runs", default=str(ROOT / "results" / "bench" / "teacher_student_mnist"),
                        help="where the MNIST benchmark's runs are (round 2 embeds with mnist-clusters' student)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 epochs, one seed, 1,800 pool images")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "student_proxy.json"))
    args = parser.parse_args()
    seeds = range(1 if args.quick else args.seeds)
    jobs = [(arm, seed) for seed in seeds for arm in args.arms]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_arm, arm, seed, args.mnist, args.runs, args.labelled, args.wrong, args.quick)
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
    simulated = any(ARMS[arm].labels != "random" for arm in args.arms)
    result = {"benchmark": "student_proxy", **soundness([SIMULATED if simulated else None]),
              **timed_on("MNIST's public pool"),
              "releases": "none: the public pool's own labels, made as noisy as a run's or put through a simulated "
                          "public-cluster release, stand in for released ones",
              "config": str(CONFIG.relative_to(ROOT)), "quick": args.quick, "seeds": len(seeds),
              "labelled_share": args.labelled, "wrong_share": args.wrong, "arms": arms, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(arms, indent=2))


if __name__ == "__main__":
    main()
