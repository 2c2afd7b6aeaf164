"""Benchmark: the small examples' vote sources — teachers, kNN votes, public-cluster votes — each run end to end.

Runs, as ``conclave run`` does (voters on Ray actors, the gRPC aggregator with its ledger, the
student actor), the demo (the digits voting for 100 public clusters) beside
configs/digits-teachers.yaml (50 digits teachers, Confident-GNMax) and configs/digits-knn.yaml
(the same digits as Private-kNN votes), and configs/hospitals.yaml (30 teachers across three owners, GNMax) beside
configs/hospitals-knn.yaml and configs/hospitals-clusters.yaml (the hospitals' records voting behind
the gateways the run starts for them, summed securely). Writes results/bench/knn_votes_examples.json: per run and
repetition the answers, label accuracy (digits only: the hospitals' pool has no labels),
student accuracy and the guarantee, and ``sound``. MNIST's rows are in
bench/teacher_student_mnist.py.

The hospitals' runs charge the example hospitals' lifetime budgets as any run does; the
benchmark keeps those ledgers in a temporary ``$CONCLAVE_HOME`` unless it is set.

    python bench/knn_votes_examples.py --repeats 3
    python bench/knn_votes_examples.py --repeats 1 --only demo digits-teachers
    python bench/knn_votes_examples.py --only demo --merge
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores  # noqa: E402  (before torch loads)

share_cores()

from bench.soundness import soundness, timed_on, timed_private_work  # noqa: E402
from conclave.cluster.api import DEMO_CONFIG, RunDirectory, load_pipeline, load_yaml, train_ensemble  # noqa: E402

log = logging.getLogger("bench.knn_votes_examples")
STAND_IN_DATA = "scikit-learn's digits and the example hospitals' synthetic tables"
STAND_IN = timed_on(STAND_IN_DATA)

CONFIGS = {
    "demo": None,  # the embedded demo (configs/demo.yaml): public-cluster votes
    "digits-teachers": "configs/digits-teachers.yaml",
    "digits-knn": "configs/digits-knn.yaml",
    "hospitals": "configs/hospitals.yaml",
    "hospitals-knn": "configs/hospitals-knn.yaml",
    "hospitals-clusters": "configs/hospitals-clusters.yaml",
}


def run_once(name: str, seed: int, results: Path) -> tuple[dict, float]:
    """One run's published figures, and its seconds end to end (for the timings file: they time
    work on the data in the private role)."""
    raw = DEMO_CONFIG if CONFIGS[name] is None else load_yaml(ROOT / CONFIGS[name])
    pipeline = load_pipeline(raw)
    pipeline = pipeline.with_config(dataclasses.replace(pipeline.config, seed=seed)).validate()
    config = pipeline.config
    started = time.perf_counter()
    try:
        with train_ensemble(config, progress=False) as voters:
            outcome = pipeline.teach(voters, RunDirectory(results, f"{name}-seed{seed}"))
    finally:
        import ray

        ray.shutdown()  # the next config starts its own Ray, each run timed from a cold start
    metrics, privacy = outcome.metrics, outcome.privacy.as_dict()
    # public-cluster votes: how many pool inputs the released medoid labels label, and how many right
    spread = {key: metrics["curve"][-1][key] for key in ("cluster_labelled", "cluster_label_accuracy")
              if metrics["curve"] and key in metrics["curve"][-1]}
    return {"seed": seed, "student_accuracy": metrics["student_accuracy"], "label_accuracy": metrics["label_accuracy"],
            **spread,
            "queries_asked": metrics["queries_asked"], "queries_answered": metrics["queries_answered"],
            "guarantee": privacy["guarantee"]["epsilon"], "epsilon_spent": privacy["spent"]["epsilon"],
            "sound": privacy["sound"], "unsound_reasons": privacy["unsound_reasons"]}, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), default=None, help="run only these configs")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each config, seeds 0, 1, ... (default 3)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results")
    parser.add_argument("--merge", action="store_true", help="update the existing results file instead of replacing it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if "CONCLAVE_HOME" not in os.environ:  # the example hospitals' lifetime ledgers, not the user's
        os.environ["CONCLAVE_HOME"] = tempfile.mkdtemp(prefix="conclave-bench-home-")

    bench_dir = RunDirectory(args.results_dir, "bench")
    runs_dir = bench_dir.path / "knn_votes_examples"
    out: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    previous = bench_dir.path / "knn_votes_examples.json"
    timings_file = bench_dir.path / "knn_votes_examples.timings.json"
    seconds: dict = {}
    if args.merge and previous.is_file():  # keep what an earlier run measured, replace what this one does
        out["runs"] = {name: run for name, run in json.loads(previous.read_text())["runs"].items() if name in CONFIGS}
        if timings_file.is_file():
            seconds = json.loads(timings_file.read_text()).get("run_seconds", {})
    for name in args.only or list(CONFIGS):
        runs = [run_once(name, seed, runs_dir) for seed in range(args.repeats)]
        repetitions = [run for run, _ in runs]
        seconds[name] = [took for _, took in runs]
        out["runs"][name] = {"repetitions": repetitions,
                             "student_accuracy_median": statistics.median(r["student_accuracy"] for r in repetitions)}
        reasons = [f"{run}: {r}" for run, result in out["runs"].items()
                   for repetition in result["repetitions"] for r in repetition["unsound_reasons"]]
        bench_dir.write_json("knn_votes_examples", {**out, **soundness(reasons)})
        bench_dir.write_json("knn_votes_examples.timings", {"run_seconds": seconds,
                                                            **soundness([timed_private_work(STAND_IN_DATA)]), **STAND_IN})
        log.info("%s: students %s, answered %s, guarantee ε %s", name,
                 [round(r["student_accuracy"], 3) for r in repetitions], [r["queries_answered"] for r in repetitions],
                 [round(r["guarantee"], 3) for r in repetitions])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
