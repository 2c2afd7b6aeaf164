"""Proxy measurements behind ``conclave plan --propose`` (``cluster/proposal.py``): public data only.

Each proxy is a table split among three owners, a pool and a labelled test table, all public:
the consortium benchmark's generator at other seeds (``PROXY_SEEDS``; never ``BENCH_SEED``), and
scikit-learn's breast-cancer and digits tables. For each, at the budget ε = 4:

* ``sources``: the real ``propose()`` sizes each vote source (public clusters, kNN votes,
  teachers) from the proxy's public figures, and its votes are replayed here in one process with
  those settings — the same embedding, clustering, nearest-query, sampling and answer code as the
  owners' actors and the mechanisms — then a student as ``actors/student.py`` trains it (the
  table MLP, self-training at 0.9) and is tested;
* ``clusters_grid``: public clusters at other counts and votes per record, σ calibrated to the same
  ε, to see where the proposal's pick falls;
* ``clusters_screening``: the proposed clusters with answers screened (a threshold of 2 and 3
  noise deviations, a purity of 0.5): fewer, more accurate labels;
* ``noiseless``: what no private run can give, for scale: the MLP trained on all the records (the
  non-private reference), the student on the pool's true labels, on the labels of a noiseless kNN
  over the records (k 20), and on the proposed clusters' votes without noise.

What this is not: a run. The releases are simulated — Gaussian noise of the secure total's
variance (O/(O − 1)·σ² with O owners) stands in for the secure sum's Skellam noise, drawn by
numpy — and the noiseless figures read the proxies' records without a mechanism, so the file is
``sound: false`` by design. Its figures chose the rules' constants; no benchmark row is read.

    python bench/proposal_proxy.py                   # every proxy (about ten minutes on 2 cores)
    python bench/proposal_proxy.py --only breast-cancer
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores  # noqa: E402  (before torch loads)

share_cores()

from bench.consortium import OWNERS, Table, make_table, user_config, write_table  # noqa: E402
from bench.soundness import soundness  # noqa: E402
from conclave.cluster.api import (  # noqa: E402
    SOURCES, MechanismConfig, Proposal, RunDirectory, load_pipeline, proposed_config, propose, smallest_sigma,
)

log = logging.getLogger("bench.proposal_proxy")
PROXY_SEEDS = (101, 202)
BUDGET = 4.0
GRID_COUNTS = (8, 4, 2, 1)  # the pool's size over these
GRID_VOTES = (3, 10, 20, 40)
SELF_TRAINING = 0.9
NOISELESS_K = 20
UNSOUND = ["simulated releases: Gaussian noise of the secure total's variance stands in for the secure sum's "
           "Skellam noise, drawn by numpy, not a run's OS-entropy noise",
           "the noiseless references read the proxies' records (public data in the owners' role) without a mechanism"]


def sklearn_table(name: str, records: int, pool: int, seed: int = 0) -> Table:
    """A bundled scikit-learn table, shuffled, cut into three owners of ``records`` rows, the pool and the test rows."""
    from sklearn.datasets import load_breast_cancer, load_digits

    x, y = (load_breast_cancer if name == "breast-cancer" else load_digits)(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    cuts = np.cumsum([records] * len(OWNERS) + [pool])
    parts = [(x[a:b], y[a:b]) for a, b in zip([0, *cuts[:-1]], cuts)]
    rest = (x[cuts[-1]:], y[cuts[-1]:])
    return Table(dict(zip(OWNERS, parts)), parts[-1], rest, rest)


def proxies(only: list[str] | None) -> dict[str, Table]:
    tables = {f"consortium-seed{seed}": lambda seed=seed: make_table(seed) for seed in PROXY_SEEDS}
    tables["breast-cancer"] = lambda: sklearn_table("breast-cancer", 100, 120)
    tables["digits"] = lambda: sklearn_table("digits", 430, 300)
    return {name: make() for name, make in tables.items() if not only or name in only}


# --- the student (actors/student.py with pseudo_label_threshold) ---------------------------


class Student:
    def __init__(self, table: Table, classes: int) -> None:
        from conclave.learning.data import Dataset
        from conclave.learning.data.schema import Standardiser

        self.table, self.classes = table, classes
        pool = table.pool[0]
        self.standardiser = Standardiser.of_public(Dataset(pool, np.zeros(len(pool), dtype=np.int64), classes, "pool"))

    def _fit(self, x: np.ndarray, y: np.ndarray):
        from conclave.cluster.api import DEFAULT_TABLE_STUDENT
        from conclave.learning.data import Dataset
        from conclave.learning.models import build_model
        from conclave.learning.training import fit

        model = build_model("mlp", self.classes, input_shape=(x.shape[1],), standardiser=self.standardiser, seed=0)
        fit(model, Dataset(x, y, self.classes, "student"), DEFAULT_TABLE_STUDENT.train)
        return model

    def reference(self) -> float:
        """The student's model trained without privacy on every owner's records: test accuracy."""
        from conclave.learning.data import Dataset
        from conclave.learning.training import evaluate

        x = np.concatenate([x for x, _ in self.table.owners.values()])
        y = np.concatenate([y for _, y in self.table.owners.values()])
        return round(evaluate(self._fit(x, y), Dataset(*self.table.test, self.classes, "test")), 4)

    def accuracy(self, keep: np.ndarray, labels: np.ndarray) -> float | None:
        """Trained on the pool rows ``keep`` labelled ``labels``, then self-trained on the rest; test accuracy."""
        import torch

        from conclave.learning.data import Dataset
        from conclave.learning.training import evaluate, predict_logits

        if len(np.unique(labels)) < 2:
            return None
        pool = self.table.pool[0]
        model = self._fit(pool[keep], labels)
        others = np.setdiff1d(np.arange(len(pool)), keep)
        if len(others):
            probabilities = torch.softmax(torch.from_numpy(predict_logits(model, pool[others])), dim=1).numpy()
            sure = probabilities.max(axis=1) >= SELF_TRAINING
            model = self._fit(np.concatenate([pool[keep], pool[others][sure]]),
                              np.concatenate([labels, probabilities[sure].argmax(axis=1)]))
        return round(evaluate(model, Dataset(*self.table.test, self.classes, "test")), 4)


def _noise_sd(sigma: float, owners: int, secure: bool) -> float:
    return sigma * math.sqrt(owners / (owners - 1)) if secure and owners > 1 else sigma


def _outcome(table: Table, student: Student, keep: np.ndarray, labels: np.ndarray, **extra) -> dict:
    right = float((labels == table.pool[1][keep]).mean()) if len(keep) else None
    return {**extra, "labelled": int(len(keep)), "label_accuracy": None if right is None else round(right, 4),
            "student_accuracy": student.accuracy(keep, labels)}


# --- the three sources, replayed ---------------------------------------------------------


def replay_clusters(table: Table, student: Student, count: int, m: int, sigma: float, secure: bool,
                    threshold: float = 0.0, purity: float = 0.0, embedding: str = "standardised-pca",
                    dims: int | None = None) -> dict:
    from conclave.learning.embeddings import fit_embedding
    from conclave.learning.selection.clusters import cluster_pool
    from conclave.privacy.exact_distances import nearest_queries
    from conclave.privacy.mechanisms.public_clusters import cluster_answers

    pool = table.pool[0]
    embed = fit_embedding(embedding, pool, dims or pool.shape[1])
    embedded = embed(pool)
    clusters = cluster_pool(embedded, count, seed=0)
    queries = embedded[clusters.medoids]
    votes = np.zeros((count, student.classes), dtype=np.int64)
    for x, y in table.owners.values():
        for column in nearest_queries(embed(x), queries, m).T:
            np.add.at(votes, (column, y), 1)
    noised = votes + np.random.default_rng().normal(0, _noise_sd(sigma, len(table.owners), secure), votes.shape)
    answers = cluster_answers(noised, threshold, purity)
    spread = clusters.spread({int(q): int(a) for q, a in zip(clusters.medoids, answers) if a >= 0})
    keep = np.fromiter(spread, dtype=np.int64, count=len(spread))
    labels = np.fromiter(spread.values(), dtype=np.int64, count=len(spread))
    return _outcome(table, student, keep, labels, count=count, votes_per_record=m, sigma=sigma)


def _asked(table: Table, queries: int) -> np.ndarray:
    """The table student's choice (``DEFAULT_TABLE_STUDENT``): k-means centres of the pool, then the pool in order."""
    from conclave.cluster.api import DEFAULT_TABLE_STUDENT
    from conclave.learning.selection.cold_start import kmeans_cold_start

    pool = table.pool[0]
    selection = DEFAULT_TABLE_STUDENT.selection
    first = kmeans_cold_start(pool, np.arange(len(pool)), min(selection.round_size, queries), selection.seed)
    return np.concatenate([first, np.setdiff1d(np.arange(len(pool)), first)])[:queries]


def replay_knn(table: Table, student: Student, settings: dict) -> dict:
    from conclave.cluster.api import declared_share
    from conclave.learning.embeddings import fit_embedding

    knn, params = settings["knn"], settings["mechanism"]["params"]
    queries = settings["student"]["queries"]
    rng = np.random.default_rng()
    embed = fit_embedding(knn["embedding"], table.pool[0], knn["dims"])
    asked = _asked(table, queries)
    points = embed(table.pool[0][asked])
    votes = np.zeros((queries, student.classes))
    shares = declared_share(knn["k"], [len(y) for _, y in table.owners.values()])
    for (x, y), k in zip(table.owners.values(), shares):
        squared = ((points[:, None, :] - embed(x)[None]) ** 2).sum(axis=-1)
        squared[rng.random(squared.shape) >= knn["sample_rate"]] = np.inf  # each query's own Poisson sample
        nearest = np.argsort(squared, axis=1, kind="stable")[:, :k]
        for row in range(queries):
            sampled = nearest[row][np.isfinite(squared[row, nearest[row]])]
            np.add.at(votes[row], y[sampled], 1)
    noised = votes + rng.normal(0, _noise_sd(params["sigma1"], len(table.owners), True), votes.shape)
    answered = noised.max(axis=1) >= params["threshold"]
    return _outcome(table, student, asked[answered], noised[answered].argmax(axis=1), asked=queries)


def replay_teachers(table: Table, student: Student, settings: dict) -> dict:
    from conclave.cluster.api import TeachersConfig
    from conclave.learning.data import Dataset
    from conclave.learning.models import build_model
    from conclave.learning.training import fit, predict_logits

    sigma, queries = settings["mechanism"]["params"]["sigma"], settings["student"]["queries"]
    rng = np.random.default_rng()
    asked = _asked(table, queries)
    votes = np.zeros((queries, student.classes))
    for owner, (x, y) in zip(settings["owners"], table.owners.values()):
        for shard in np.array_split(rng.permutation(len(y)), owner["teachers"]):
            model = build_model("mlp", student.classes, input_shape=(x.shape[1],), standardiser=student.standardiser)
            fit(model, Dataset(x[shard], y[shard], student.classes, "teacher"), TeachersConfig().train)
            votes[np.arange(queries), predict_logits(model, table.pool[0][asked]).argmax(axis=1)] += 1
    labels = (votes + rng.normal(0, sigma, votes.shape)).argmax(axis=1)
    teachers = sum(owner["teachers"] for owner in settings["owners"])
    return _outcome(table, student, asked, labels, asked=queries, teachers=teachers)


# --- one proxy ---------------------------------------------------------------------------


def measure(name: str, table: Table, folder: Path) -> dict:
    from sklearn.neighbors import KNeighborsClassifier

    from conclave.learning.embeddings import fit_embedding

    classes = int(max(table.test[1].max(), table.pool[1].max(), *(y.max() for _, y in table.owners.values())) + 1)
    student = Student(table, classes)
    paths = write_table(table, folder / name)
    records = len(next(iter(table.owners.values()))[1])
    raw = user_config(paths, OWNERS, records, BUDGET, name)
    proposals: dict[str, Proposal] = {source: propose(raw, source) for source in SOURCES}
    out: dict = {"owners": len(table.owners), "records": records * len(table.owners), "classes": classes,
                 "pool": len(table.pool[1]), "budget": BUDGET, "sources": {}}
    for source, proposal in proposals.items():
        settings = proposal.sections
        if source == "clusters":
            section, params = settings["clusters"], settings["mechanism"]["params"]
            result = replay_clusters(table, student, section["count"], section["votes_per_record"], params["sigma"],
                                     proposal.figures.secure, dims=section["dims"])
        else:
            result = (replay_knn if source == "knn" else replay_teachers)(table, student, settings)
        out["sources"][source] = {"rule": proposal.rule, "planned_epsilon": proposal.planned_worst_case, **result}
        log.info("%s %s: %s", name, source, out["sources"][source])

    # the grid: σ of each m as the proposal calibrates it (one release: the count does not change it)
    base = load_pipeline(proposed_config(raw, proposals["clusters"].sections)).config
    pool = len(table.pool[1])
    out["clusters_grid"] = []
    for m in GRID_VOTES:
        config = dataclasses.replace(base, clusters=dataclasses.replace(base.clusters, votes_per_record=m),
                                     mechanism=MechanismConfig("public-clusters", {"sigma": 1.0}))
        sigma = smallest_sigma(lambda s: dataclasses.replace(config, mechanism=MechanismConfig("public-clusters",
                                                                                               {"sigma": s})),
                               BUDGET, high=1e4)
        for count in sorted({max(2 * m, min(pool // divisor, base.server.max_batch)) for divisor in GRID_COUNTS}):
            cell = replay_clusters(table, student, count, m, sigma, proposals["clusters"].figures.secure)
            out["clusters_grid"].append(cell)
            log.info("%s grid: %s", name, cell)

    chosen = proposals["clusters"]
    section, sigma = chosen.sections["clusters"], chosen.sections["mechanism"]["params"]["sigma"]
    deviation = _noise_sd(sigma, len(table.owners), chosen.figures.secure)

    def proposed(sigma: float = sigma, **screening: float) -> dict:
        return replay_clusters(table, student, section["count"], section["votes_per_record"], sigma,
                               chosen.figures.secure, dims=section["dims"], **screening)

    out["clusters_screening"] = [{"threshold_deviations": 2, **proposed(threshold=2 * deviation)},
                                 {"threshold_deviations": 3, **proposed(threshold=3 * deviation)},
                                 {"purity": 0.5, **proposed(purity=0.5)}]
    log.info("%s screening: %s", name, out["clusters_screening"])
    embed = fit_embedding("standardised-pca", table.pool[0], table.pool[0].shape[1])
    x = np.concatenate([x for x, _ in table.owners.values()])
    y = np.concatenate([y for _, y in table.owners.values()])
    knn_labels = KNeighborsClassifier(NOISELESS_K).fit(embed(x), y).predict(embed(table.pool[0]))
    everything = np.arange(pool)
    out["noiseless"] = {"mlp_on_all_records": student.reference(),
                        "proposed_clusters_without_noise": proposed(sigma=0.0),
                        "student_on_true_pool_labels": student.accuracy(everything, table.pool[1]),
                        f"knn{NOISELESS_K}_label_accuracy": round(float((knn_labels == table.pool[1]).mean()), 4),
                        f"student_on_knn{NOISELESS_K}_labels": student.accuracy(everything, knn_labels)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="these proxies only")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    bench_dir = RunDirectory(args.results_dir, "bench")
    out: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "proxies": {}}
    with tempfile.TemporaryDirectory(prefix="conclave-proxy-") as folder:
        for name, table in proxies(args.only).items():
            out["proxies"][name] = measure(name, table, Path(folder))
            bench_dir.write_json("proposal_proxy", {**out, **soundness(UNSOUND)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
