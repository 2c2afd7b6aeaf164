"""The committed benchmark results say what each ε is: a guarantee, with estimates apart."""
from __future__ import annotations

import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench"


def test_every_teacher_student_run_publishes_its_guarantee_and_keeps_estimates_apart():
    runs = json.loads((RESULTS / "teacher_student_mnist.json").read_text())["runs"]
    assert {"mnist-gnmax-scatternet", "mnist-gnmax", "mnist-nzc"} <= set(runs)
    for name, run in runs.items():
        guarantee = run["guarantee"]
        assert 0 < run["student_accuracy"] <= 1, name
        assert guarantee["basis"] in {"renyi-filter", "worst-case", "unbounded"}, name
        assert 0 < guarantee["delta"] < 1, name
        epsilon = math.inf if guarantee["epsilon"] == "inf" else float(guarantee["epsilon"])
        # sound exactly when a theorem bounds the loss: a finite guarantee from OS-entropy noise
        assert run["sound"] == math.isfinite(epsilon), name
        assert isinstance(run["estimates"], dict), name  # data-dependent figures, under their own names
        if guarantee["basis"] == "renyi-filter":
            assert float(run["epsilon_spent"]) <= epsilon + 1e-9, name  # the filter held
    assert runs["mnist-nzc"]["estimates"]["paper-claim"] < 1e-6  # the claim, beside an unbounded guarantee


def test_the_perf_benchmark_records_every_ratio_as_min_and_median():
    perf = json.loads((RESULTS / "perf.json").read_text())
    allocator = [model for model in perf["allocator"].values() if isinstance(model, dict) and "bk_speedup" in model]
    figures = [perf["teacher_inference"]["flop_fraction"], perf["teacher_pool"]["speedup"],
               *(model["step_ratio"] for model in perf["dpsgd"].values()),
               *(model["bk_speedup"] for model in allocator)]
    assert allocator and perf["thread_settings"]["MALLOC_MMAP_MAX_"] == "0"  # the run kept freed memory
    assert all(set(figure) == {"min", "median"} and 0 < figure["min"] <= figure["median"] for figure in figures)
    assert perf["teacher_inference"]["identical_votes"] is True
    assert perf["aggregator"]["p99_ms"] > 0 and "torch_threads" in perf["thread_settings"]
    assert perf["aggregator"]["budget_epsilon"] < float("inf") and perf["aggregator"]["thread_handoff_ms"]["p99"] > 0
