"""Benchmark: a consortium's own table, run with the settings ``conclave plan --propose`` gives it.

Issue 36's case: three owners × 800 rows, 6 classes, 15 columns (scikit-learn's
make_classification, seed ``BENCH_SEED``), a public pool of 600 rows and a labelled public test
table of 600 from the same draw. The owners' config is the one a user writes first: their CSVs,
their declared ``records``, a budget of ε = 4 and nothing else. The benchmark then does what the
user would:

1. ``conclave plan consortium.yaml --propose proposed.yaml --source S`` for each vote source S
   (public figures only: the declared records, the classes, the pool's size, the budget);
   public clusters are what ``--propose`` gives without ``--source``;
2. ``conclave run proposed.yaml`` three times each, end to end (owners' actors on Ray, the secure
   sum, the aggregator and its ledger, the student actor), each run's DP noise its own;
3. the reference: the same MLP as the student's, trained without privacy on 2,400 rows. The
   published one learns from a public twin — 2,400 more rows of the same draw, the owners' size
   — so no figure in the results file is computed from rows in the owners' role without a
   mechanism; the MLP on the owners' own rows goes to
   ``results/bench/consortium.nonprivate-diagnostics.json`` (for the operator, never committed).

The goal (issue 36): every student within 10 points of the non-private MLP at a guaranteed
ε ≤ 4, with the settings ``conclave plan --propose`` gives. ``results/bench/consortium.json``
states, per source, the proposal, each run's student accuracy, label accuracy and guarantee, the
shortfall in points and ``goal_met``; the reference; ``goal_met`` of plan's default. No time is
recorded.

The table's parameters (``TABLE``) were fixed before any private run: of the generators tried,
the one whose non-private MLP on 2,400 rows of proxy seeds (101, 202, 303) came closest to the
issue's 0.89. Proxies of the proposal's rules use other seeds (``bench/proposal_proxy.py``).

    python bench/consortium.py                # three runs of each source's proposal (15 minutes on 2 cores)
    python bench/consortium.py --repeats 1 --sources clusters
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores  # noqa: E402  (before torch loads)

share_cores()

import yaml  # noqa: E402

from bench.soundness import soundness  # noqa: E402
from conclave.cluster.api import SOURCES, RunDirectory  # noqa: E402

log = logging.getLogger("bench.consortium")

# make_classification's settings, beside the counts (15 columns, 6 classes); see the docstring
TABLE = {"n_features": 15, "n_informative": 6, "n_redundant": 3, "n_classes": 6, "n_clusters_per_class": 1,
         "class_sep": 1.0}
BENCH_SEED = 2024
OWNERS, RECORDS, POOL, TEST = ("owner_a", "owner_b", "owner_c"), 800, 600, 600
BUDGET, DELTA = 4.0, 1e-5
GOAL_POINTS = 0.10  # within 10 points of the non-private MLP
REFERENCE_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Table:
    """One draw: each owner's rows, the public pool, the labelled test table and a public twin of
    the owners' rows (as many rows again, from the same draw, in the public role)."""

    owners: dict[str, tuple[np.ndarray, np.ndarray]]
    pool: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    twin: tuple[np.ndarray, np.ndarray]


def make_table(seed: int, owners: tuple[str, ...] = OWNERS, records: int = RECORDS, pool: int = POOL,
               test: int = TEST, **table: int | float) -> Table:
    """One make_classification draw (rows shuffled) cut in order into the owners', pool, test and twin rows."""
    from sklearn.datasets import make_classification

    private = len(owners) * records
    x, y = make_classification(n_samples=2 * private + pool + test, random_state=seed, **{**TABLE, **table})
    x, y = x.astype(np.float32), y.astype(np.int64)
    cuts = np.cumsum([records] * len(owners) + [pool, test])
    parts = [(x[a:b], y[a:b]) for a, b in zip([0, *cuts[:-1]], cuts)]
    return Table(dict(zip(owners, parts)), parts[-2], parts[-1], (x[cuts[-1]:], y[cuts[-1]:]))


def write_table(table: Table, folder: Path) -> dict[str, Path]:
    """CSVs (columns x0…, then label) of the owners, the pool (labels kept, only to measure the
    released labels' accuracy: the student never sees them) and the test table."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (x, y) in {**table.owners, "public": table.pool, "test": table.test}.items():
        frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(x.shape[1])])
        frame["label"] = [f"class_{label}" for label in y]
        paths[name] = folder / f"{name}.csv"
        frame.to_csv(paths[name], index=False)
    return paths


def user_config(paths: dict[str, Path], owners: tuple[str, ...], records: int, budget: float = BUDGET,
                name: str = "consortium") -> dict:
    """The config a consortium writes first: its owners' files and declared records, a budget, the rest default."""
    return {"pipeline": "teacher_student", "name": name,
            "owners": [{"name": owner, "data": {"format": "csv", "path": str(paths[owner]), "label": "label"},
                        "records": records} for owner in owners],
            "public": {"format": "csv", "path": str(paths["public"]), "label": "label"},
            "test": {"format": "csv", "path": str(paths["test"]), "label": "label"},
            "privacy": {"budget": budget, "delta": DELTA}}


def mlp_accuracy(rows: tuple[np.ndarray, np.ndarray], pool: np.ndarray, test: tuple[np.ndarray, np.ndarray],
                 seed: int, classes: int) -> float:
    """The student's model and training (the table default: ``mlp``, 40 epochs), without privacy,
    its columns standardised by the pool's statistics as the student's are."""
    import dataclasses

    from conclave.cluster.api import DEFAULT_TABLE_STUDENT
    from conclave.learning.data import Dataset
    from conclave.learning.data.schema import Standardiser
    from conclave.learning.models import build_model
    from conclave.learning.training import evaluate, fit

    standardiser = Standardiser.of_public(Dataset(pool, np.zeros(len(pool), dtype=np.int64), classes, "pool"))
    model = build_model("mlp", classes, input_shape=(pool.shape[1],), standardiser=standardiser, seed=seed)
    fit(model, Dataset(*rows, classes, "reference"), dataclasses.replace(DEFAULT_TABLE_STUDENT.train, seed=seed))
    return evaluate(model, Dataset(*test, classes, "test"))


def conclave(*argv: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "conclave", *argv], cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"conclave {' '.join(argv)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result


def run_proposed(config: Path, results: Path, run_name: str) -> dict:
    """``conclave run`` of the proposed config; what its results folder states."""
    conclave("run", str(config), "--results-dir", str(results), "--run-name", run_name)
    metrics = json.loads((results / run_name / "metrics.json").read_text())
    privacy = json.loads((results / run_name / "privacy.json").read_text())
    guarantee = privacy["guarantee"]
    return {"run": run_name, "student_accuracy": metrics["student_accuracy"],
            "label_accuracy": metrics["label_accuracy"], "queries_asked": metrics["queries_asked"],
            "queries_answered": metrics["queries_answered"],
            "guarantee": {key: guarantee[key] for key in ("epsilon", "delta", "basis", "theorem")},
            "sound": privacy["sound"], "unsound_reasons": privacy["unsound_reasons"]}


def propose_and_run(source: str, user: Path, work: Path, repeats: int, reference: float) -> dict:
    """``conclave plan --propose --source`` for ``user``, then ``repeats`` runs of what it proposed."""
    proposed = work / f"proposed-{source}.yaml"
    conclave("plan", str(user), "--propose", str(proposed), "--source", source)
    sections = yaml.safe_load(proposed.read_text())
    result: dict = {
        "proposal": {key: sections[key] for key in ("clusters", "knn", "mechanism", "aggregation", "student")
                     if key in sections},
        "teachers_by_owner": {o["name"]: o["teachers"] for o in sections["owners"]} if source == "teachers" else None,
        "proposal_comment": [line[2:] for line in proposed.read_text().splitlines() if line.startswith("# ")],
        "runs": []}
    for repeat in range(repeats):
        run = run_proposed(proposed, work / "runs", f"consortium-{source}-{repeat + 1}")
        result["runs"].append(run)
        log.info("%s run %d: student %.3f, label accuracy %s, guarantee ε %.4g", source, repeat + 1,
                 run["student_accuracy"], run["label_accuracy"], run["guarantee"]["epsilon"])
    students = [run["student_accuracy"] for run in result["runs"]]
    result["shortfall_points"] = round(max(0.0, reference - GOAL_POINTS - min(students)) * 100, 2)
    result["goal_met"] = result["shortfall_points"] == 0 and all(
        run["guarantee"]["epsilon"] <= BUDGET and run["sound"] for run in result["runs"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each proposed config (default 3)")
    parser.add_argument("--sources", nargs="*", choices=SOURCES, default=list(SOURCES),
                        help="the vote sources to propose and run (default: all; plan's default is the first)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if "CONCLAVE_HOME" not in os.environ:  # the synthetic owners' lifetime ledgers, not the user's
        os.environ["CONCLAVE_HOME"] = tempfile.mkdtemp(prefix="conclave-bench-home-")
    bench_dir = RunDirectory(args.results_dir, "bench")
    work = bench_dir.path / "consortium"  # data, configs and runs: local only (results/bench/*/ is not committed)
    table = make_table(BENCH_SEED)
    paths = write_table(table, work / "data")
    user = work / "consortium.yaml"
    user.write_text(yaml.safe_dump(user_config(paths, OWNERS, RECORDS), sort_keys=False))

    classes = TABLE["n_classes"]
    twin = [mlp_accuracy(table.twin, table.pool[0], table.test, seed, classes) for seed in REFERENCE_SEEDS]
    reference = float(np.mean(twin))
    owners_rows = tuple(np.concatenate(part) for part in zip(*table.owners.values()))
    bench_dir.write_json("consortium.nonprivate-diagnostics", {
        "warning": "NON-PRIVATE DIAGNOSTICS: the reference MLP trained on the owners' own rows, without a DP "
                   "mechanism, on a synthetic table, for the operator; never part of a published result",
        "test_accuracy_by_seed": [mlp_accuracy(owners_rows, table.pool[0], table.test, seed, classes)
                                  for seed in REFERENCE_SEEDS],
        **soundness(["computed from the owners' rows without a DP mechanism"])})
    out: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "table": {"generator": "sklearn.datasets.make_classification", **TABLE, "seed": BENCH_SEED,
                  "owners": {name: RECORDS for name in OWNERS}, "pool": POOL, "test": TEST},
        "budget": {"epsilon": BUDGET, "delta": DELTA},
        "reference": {"model": "mlp, the student's training (40 epochs), no privacy",
                      "trained_on": f"a public twin: {len(table.twin[1])} more rows of the same draw (the owners' "
                                    "size), none of them an owner's",
                      "test_accuracy_by_seed": twin, "test_accuracy": reference},
        "goal": f"every student within {GOAL_POINTS * 100:g} points of the non-private MLP at a guaranteed "
                f"ε ≤ {BUDGET:g}, with the settings conclave plan proposes (its default: {SOURCES[0]})",
        "sources": {},
    }
    for source in args.sources:
        out["sources"][source] = propose_and_run(source, user, work, args.repeats, reference)
        if source == SOURCES[0]:
            out["goal_met"] = out["sources"][source]["goal_met"]
        bench_dir.write_json("consortium", {**out, **soundness(
            f"{source} {run['run']}: {reason}" for source, result in out["sources"].items()
            for run in result["runs"] for reason in run["unsound_reasons"])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
