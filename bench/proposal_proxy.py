"""Proxy measurements behind ``conclave plan --propose`` (``cluster/proposal.py``): public data only.

Each proxy is a table split among owners, a pool and a labelled test table, all public: the
consortium benchmark's three shapes (``bench/consortium.py``'s ``TABLES``) at other seeds
(``PROXY_SEEDS``; never its ``BENCH_SEEDS``), and scikit-learn's breast-cancer and digits tables
split among three owners. For each, at the budgets ε 4 and 1:

* ``choice``: what ``propose()`` chooses from the proxy's public figures, and why;
* ``dpsgd``: the real ``propose(raw, "dpsgd")`` sizes DP-SGD across the owners, and it is replayed
  here in one process on the owners' rows pooled — its screening run where it has one, the same
  model, ``learning.dpsgd.train_dp``, full batch, the proposed σ, steps and learning rate — and its
  model is tested, beside a student (as below) trained on the DP model's labels of the pool (free
  post-processing); ``dpsgd_models``: the same with each of the proposal's table models without
  screening, σ calibrated alike, to see where the rule's pick falls;
* ``clusters``: the real ``propose(raw, "clusters")``, its votes replayed with the same embedding,
  clustering and nearest-medoid code as the owners' actors, then a student as ``actors/student.py``
  trains it (the table MLP, self-training at 0.9) and is tested; ``--sources knn teachers`` replays
  those sources too (below public clusters on every proxy when last measured);
* ``nonprivate``: what no private run can give, for scale: scikit-learn's MLP and gradient
  boosting on the owners' rows pooled, and the student on the pool's true labels.

What this is not: a run. The releases are simulated — Gaussian noise of the secure total's
variance stands in for the secure sum's Skellam noise — and the non-private figures read the
proxies' records without a mechanism, so the file is ``sound: false`` by design. Its figures chose
the rules' constants; no benchmark row is read.

    python bench/proposal_proxy.py                   # every proxy (about half an hour on 2 cores)
    python bench/proposal_proxy.py --only a-seed101 breast-cancer
"""
from __future__ import annotations

import argparse
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

from bench.consortium import (  # noqa: E402
    TABLES, Table, make_table, owner_names, sklearn_references, user_config, write_table,
)
from bench.soundness import soundness  # noqa: E402
from conclave.cluster.api import (  # noqa: E402
    DPSGD, TABLE_MODELS, Proposal, load_pipeline, proposed_config, propose, smallest_sigma,
)

log = logging.getLogger("bench.proposal_proxy")
PROXY_SEEDS = (101, 202)
BUDGETS = (4.0, 1.0)
SELF_TRAINING = 0.9
UNSOUND = ["simulated releases: Gaussian noise of the secure total's variance stands in for the secure sum's "
           "Skellam noise, drawn by numpy, not a run's OS-entropy noise",
           "the non-private references read the proxies' records (public data in the owners' role) without a "
           "mechanism"]


def sklearn_table(name: str, records: int, pool: int, seed: int = 0) -> Table:
    """A bundled scikit-learn table, shuffled, cut into three owners of ``records`` rows, the pool and the test rows."""
    from sklearn.datasets import load_breast_cancer, load_digits

    x, y = (load_breast_cancer if name == "breast-cancer" else load_digits)(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    cuts = np.cumsum([records] * 3 + [pool])
    parts = [(x[a:b], y[a:b]) for a, b in zip([0, *cuts[:-1]], cuts)]
    rest = (x[cuts[-1]:], y[cuts[-1]:])
    twin = (np.concatenate([x for x, _ in parts[:3]]), np.concatenate([y for _, y in parts[:3]]))
    return Table(dict(zip(owner_names(TABLES["a"]), parts)), parts[-1], rest, twin,
                 tuple(f"class_{i}" for i in range(int(y.max()) + 1)))


def proxies(only: list[str] | None) -> dict[str, Table]:
    tables = {f"{shape}-seed{seed}": lambda shape=shape, seed=seed: make_table(TABLES[shape], seed)
              for shape in TABLES for seed in PROXY_SEEDS}
    tables["breast-cancer"] = lambda: sklearn_table("breast-cancer", 100, 120)
    tables["digits"] = lambda: sklearn_table("digits", 430, 300)
    return {name: make() for name, make in tables.items() if not only or name in only}


def filled(table: Table) -> Table:
    """``table`` with every missing cell given the pool's column mean, as a run reads its tables."""
    means = np.nanmean(table.pool[0], axis=0)

    def fill(part: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return np.where(np.isnan(part[0]), means, part[0]).astype(np.float32), part[1]

    return Table({name: fill(part) for name, part in table.owners.items()}, fill(table.pool), fill(table.test),
                 fill(table.twin), table.classes)


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


# --- DP-SGD across the owners, replayed ----------------------------------------------------


def replay_dpsgd(table: Table, student: Student, settings: dict, with_student: bool = False) -> dict:
    """The proposed DP-SGD (``settings``: its sections) on the owners' rows pooled, one process:
    its screening run first where it has one (logistic regression for ``screen_steps`` at the same σ,
    its weights choosing the columns the model reads), then the model's test accuracy;
    ``with_student``: also a student's trained on the DP model's labels of the pool (free post-processing)."""
    from conclave.learning.data import Dataset
    from conclave.learning.dp_schedule import DPSGDConfig
    from conclave.learning.dpsgd import train_dp
    from conclave.learning.models import build_model
    from conclave.learning.models.table import SCREENING_MODEL, kept_columns
    from conclave.learning.training import evaluate
    from conclave.privacy.noise import SECURE

    section = settings["dpsgd"]
    x = np.concatenate([x for x, _ in table.owners.values()])
    y = np.concatenate([y for _, y in table.owners.values()])
    owners = Dataset(x, y, student.classes, "owners")

    def trained(model_name: str, steps: int, standardiser):
        model = build_model(model_name, student.classes, input_shape=(x.shape[1],), standardiser=standardiser,
                            seed=0)
        config = DPSGDConfig(epochs=steps, batch_size=section["batch_size"], lr=section["lr"],
                             momentum=section["momentum"], max_grad_norm=section["max_grad_norm"],
                             noise_multiplier=section["noise_multiplier"], lr_schedule=section["lr_schedule"],
                             grad_sample_mode="hooks")
        train_dp(model, owners, config, SECURE.source("proxy-dpsgd"), num_examples=section["batch_size"])
        return model

    standardiser, screened = student.standardiser, {}
    if section.get("screen_steps"):
        screening = trained(SCREENING_MODEL, section["screen_steps"], standardiser)
        keep = kept_columns(screening.classifier.weight.detach().numpy(), section["screen_keep"])
        standardiser, screened = standardiser.keeping(keep), {"screen_steps": section["screen_steps"],
                                                              "kept_columns": int(keep.sum())}
    model = trained(settings["model"], section["epochs"], standardiser)
    out = {"model": settings["model"], "sigma": section["noise_multiplier"], "steps": section["epochs"], **screened,
           "test_accuracy": round(evaluate(model, Dataset(*table.test, student.classes, "test")), 4)}
    if with_student:
        from conclave.learning.training import predict

        out["student_on_its_pool_labels"] = student.accuracy(np.arange(len(table.pool[1])), predict(model, table.pool[0]))
    return out


def with_model(raw: dict, proposal: Proposal, model: str, budget: float) -> dict:
    """The DP-SGD proposal's sections with ``model`` instead and no screening, σ calibrated to ``budget`` alike."""
    dpsgd = {key: value for key, value in proposal.sections["dpsgd"].items() if not key.startswith("screen_")}
    sections = {**proposal.sections, "model": model, "dpsgd": dpsgd}

    def build(sigma: float):
        return load_pipeline(proposed_config(raw, {**sections, "dpsgd": {**sections["dpsgd"], "noise_multiplier": sigma}}))

    sigma = smallest_sigma(build, budget, high=1e4)
    return {**sections, "dpsgd": {**sections["dpsgd"], "noise_multiplier": sigma}}


# --- one proxy ---------------------------------------------------------------------------


def measure(name: str, table: Table, folder: Path, sources: list[str]) -> dict:
    classes = len(table.classes)
    paths = write_table(table, folder / name)
    table = filled(table)
    student = Student(table, classes)
    owners = {owner: len(y) for owner, (_, y) in table.owners.items()}
    out: dict = {"owners": owners, "classes": classes, "columns": int(table.pool[0].shape[1]),
                 "pool": len(table.pool[1]), "budgets": {}}
    for budget in BUDGETS:
        raw = user_config(paths, owners, budget, name, lifetime=budget)
        choice = propose(raw)
        cell: dict = {"choice": choice.choice, "reason": choice.reason}
        dpsgd = propose(raw, DPSGD)
        dp_raw = proposed_config(raw, {"pipeline": dpsgd.sections["pipeline"]})
        cell["dpsgd"] = {"rule": dpsgd.rule, "planned_epsilon": dpsgd.planned_worst_case,
                         **replay_dpsgd(table, student, dpsgd.sections, with_student=True)}
        cell["dpsgd_models"] = [replay_dpsgd(table, student, with_model(dp_raw, dpsgd, model, budget))
                                for model in TABLE_MODELS
                                if model != dpsgd.sections["model"] or "screen_steps" in dpsgd.sections["dpsgd"]]
        log.info("%s ε %g dpsgd: %s, other models %s", name, budget, cell["dpsgd"], cell["dpsgd_models"])
        clusters = propose(raw, "clusters")
        section, params = clusters.sections["clusters"], clusters.sections["mechanism"]["params"]
        cell["clusters"] = {"rule": clusters.rule, "planned_epsilon": clusters.planned_worst_case,
                            **replay_clusters(table, student, section["count"], section["votes_per_record"],
                                              params["sigma"], clusters.figures.secure, dims=section["dims"])}
        log.info("%s ε %g clusters: %s", name, budget, cell["clusters"])
        for source in sources:
            proposal = propose(raw, source)
            replay = replay_knn if source == "knn" else replay_teachers
            cell[source] = {"rule": proposal.rule, **replay(table, student, proposal.sections)}
        out["budgets"][f"{budget:g}"] = cell
    references = sklearn_references(tuple(np.concatenate(part) for part in zip(*table.owners.values())),
                                    table.pool[0], table.test, 0)
    out["nonprivate"] = {**{key: round(value, 4) for key, value in references.items()},
                         "student_on_true_pool_labels": student.accuracy(np.arange(len(table.pool[1])), table.pool[1])}
    log.info("%s non-private: %s", name, out["nonprivate"])
    return out


def main(argv: list[str] | None = None) -> int:
    from conclave.cluster.api import RunDirectory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="these proxies only")
    parser.add_argument("--sources", nargs="*", choices=("knn", "teachers"), default=[],
                        help="also replay these vote sources")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    bench_dir = RunDirectory(args.results_dir, "bench")
    out: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "proxies": {}}
    with tempfile.TemporaryDirectory(prefix="conclave-proxy-") as folder:
        for name, table in proxies(args.only).items():
            out["proxies"][name] = measure(name, table, Path(folder), args.sources)
            bench_dir.write_json("proposal_proxy", {**out, **soundness(UNSOUND)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
