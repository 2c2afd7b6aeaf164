"""The committed benchmark results say what each ε is: a guarantee, with estimates apart."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bench.teacher_student_mnist import load_config

RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench"


def test_every_benchmark_result_says_whether_it_is_sound_and_why_not():
    files = sorted(RESULTS.glob("*.json"))
    assert {"active_learning_mnist", "perf", "service_soak", "sparse_finetune", "stability_ensemble_size",
            "teacher_student_mnist"} <= {f.stem for f in files}
    for file in files:
        result = json.loads(file.read_text())
        reasons = result["unsound_reasons"]
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons), file.name
        assert result["sound"] is (not reasons), file.name


def test_every_teacher_student_run_publishes_its_guarantee_and_keeps_estimates_apart():
    result = json.loads((RESULTS / "teacher_student_mnist.json").read_text())
    runs = result["runs"]
    assert result["sound"] == all(run["sound"] for run in runs.values())  # NZC's runs have no finite ε
    assert runs  # the runs measured on this build (results.md marks the rest to be re-run)
    for name, run in runs.items():
        guarantee = run["guarantee"]
        assert 0 < run["student_accuracy"] <= 1, name
        assert guarantee["basis"] in {"renyi-filter", "worst-case", "composed", "unbounded"}, name
        assert 0 < guarantee["delta"] < 1, name
        epsilon = math.inf if guarantee["epsilon"] == "inf" else float(guarantee["epsilon"])
        # sound exactly when a theorem bounds the loss: a finite guarantee from OS-entropy noise
        assert run["sound"] == math.isfinite(epsilon), name
        assert isinstance(run["estimates"], dict), name  # data-dependent figures, under their own names
        if guarantee["basis"] == "renyi-filter":
            assert float(run["epsilon_spent"]) <= epsilon + 1e-9, name  # the filter held
    for name, ceiling in result.get("ceiling", {}).items():  # true pool labels: said so, and no ε beside it
        assert "non-private" in ceiling["note"] and not {"guarantee", "epsilon", "sound"} & set(ceiling), name
    if "mnist-nzc" in runs:
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


def test_the_sparse_benchmark_publishes_no_private_statistic_and_composes_its_runs():
    result = json.loads((RESULTS / "sparse_finetune.json").read_text())
    runs = result["runs"]
    assert result["sound"] and result["complete"] and len(runs) == 14
    for run in runs:  # of the private fine-tunings, only the DP model's test accuracy
        assert not {"losses", "seconds", "cpu_seconds"} & set(run), run["variant"]
        assert 0 < run["epsilon"] <= run["target_epsilon"], run["variant"]
    assert "public" in result["noise_to_gradient_ratio_at_epsilon_1"]["measured_on"]
    guarantee = result["guarantee_all_runs"]  # every run trained on the same private set
    assert guarantee["basis"] == "worst-case" and guarantee["sound"]
    assert max(r["epsilon"] for r in runs) < guarantee["epsilon"] <= sum(r["epsilon"] for r in runs)


def _timing_keys(node, path: str = "") -> list[str]:
    """Every key of a JSON tree that names a time or a rate."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if any(word in key for word in ("seconds", "per_second", "_ms")):
                found.append(f"{path}.{key}")
            found += _timing_keys(value, f"{path}.{key}")
    elif isinstance(node, list):
        for item in node:
            found += _timing_keys(item, path)
    return found


def test_every_benchmark_that_publishes_timings_says_they_were_measured_on_public_stand_in_data():
    # A run on an owner's records publishes no time of its private work; a benchmark may time the
    # same code on public stand-in data, and says so (bench.soundness.timed_on). The service soak
    # (bench/service_soak.py) times the serving path alone and is left to its own file.
    for name in ("active_learning_mnist", "audits", "knn_votes_examples.timings", "perf", "sparse_finetune",
                 "stability_ensemble_size", "student_proxy", "student_proxy_eps01", "student_proxy_eps01_spread",
                 "student_proxy_labels", "student_proxy_relu", "teacher_student_mnist.timings", "device_times",
                 "gateway_overhead"):
        result = json.loads((RESULTS / f"{name}.json").read_text())
        assert _timing_keys(result), name
        assert result["timings"].startswith("measured on public stand-in data ("), name


def test_times_of_the_private_roles_work_are_not_in_a_sound_file():
    """How long teachers took to train, a run took, or a search over the records took is a figure
    of the records, so a file that states one is not sound; the MNIST and small examples' run times sit apart."""
    for name in ("teacher_student_mnist", "knn_votes_examples"):
        assert not _timing_keys(json.loads((RESULTS / f"{name}.json").read_text())), name
    for name in ("teacher_student_mnist.timings", "knn_votes_examples.timings", "device_times", "gateway_overhead"):
        result = json.loads((RESULTS / f"{name}.json").read_text())
        assert not result["sound"] and any("times work on the data in the private role" in reason
                                           for reason in result["unsound_reasons"]), name


def test_a_repeated_mnist_run_is_its_round_again_under_its_own_name():
    """``NAME@k``: the k-th draw of NAME's settings (its own noise and row); nothing else changes."""
    mnist = Path("../shared/data/mnist")
    first = load_config("mnist-clusters-eps03-r3", mnist, quick=False)
    again = load_config("mnist-clusters-eps03-r3@2", mnist, quick=False)
    assert again.name == "mnist-clusters-eps03-r3@2"
    assert dataclasses.replace(again, name=first.name) == first
    for wrong in ("mnist-clusters-eps03-r3@1", "mnist-clusters-eps03-r3@b"):
        with pytest.raises(ValueError, match="NAME@k"):
            load_config(wrong, mnist, quick=False)
