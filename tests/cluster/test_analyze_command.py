"""`conclave analyze`: the real console entry in a subprocess, and every bad input in-process."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cluster import analyze_command
from privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from privacy.accounting.report import analysis_report
from privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from privacy.mechanisms import build_mechanism
from privacy.noise import NoisePolicy

PROJECT = Path(__file__).resolve().parents[2]
CONCLAVE = PROJECT / ".venv" / "bin" / "conclave"


def strict_json(text: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    top = rng.integers(120, 251, size=60)
    second = rng.integers(0, 251 - top)  # upper bound exclusive: the third count stays >= 0
    votes = np.stack([top, second, 250 - top - second], axis=1).astype(np.int64)
    answered = votes.max(axis=1) + rng.normal(0, 150, size=60) >= 200
    folder = tmp_path_factory.mktemp("analyze")
    np.save(folder / "votes.npy", votes)
    np.save(folder / "answered.npy", answered)
    return folder / "votes.npy", folder / "answered.npy", votes, answered


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CONCLAVE), "analyze", *argv], capture_output=True, text=True, timeout=120, cwd=PROJECT)


def test_console_entry_prints_the_report_as_one_json_object(run_files):
    votes_path, mask_path, votes, answered = run_files
    args = ["--mechanism", "confident-gnmax", "--sigma1", "150", "--threshold", "200", "--sigma", "40"]
    done = run_cli(str(votes_path), *args, "--answered", str(mask_path), "--json")
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    assert report["mechanism"]["name"] == "confident-gnmax" and report["sound"] is True
    assert report["queries"] == 60 and report["answered"] == int(answered.sum())
    guarantee = report["guarantee"]
    assert set(guarantee) >= {"epsilon", "delta", "basis", "neighbouring", "theorem"}
    assert guarantee["basis"] == "worst-case" and guarantee["neighbouring"] == "one-vote"
    # the guarantee is at least the data-independent ε with every one of the 60 queries answered
    all_answered = 60 * DEFAULT_ORDERS / (2 * 150.0**2) + 60 * DEFAULT_ORDERS / 40.0**2
    assert guarantee["epsilon"] >= epsilon_from_rdp(DEFAULT_ORDERS, all_answered, 1e-5)[0]
    names = {e["name"]: e for e in report["estimates"]}
    assert set(names) == {"data-dependent", "smooth-sensitivity"}
    assert all(e["label"] == "estimate: not a DP guarantee" for e in names.values())
    assert names["data-dependent"]["private"] and not names["smooth-sensitivity"]["private"]
    assert names["data-dependent"]["epsilon"] < guarantee["epsilon"]


def test_the_same_numbers_as_the_library_with_the_same_insecure_seed(run_files, capsys):
    votes_path, mask_path, votes, answered = run_files
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "confident-gnmax", "--sigma1", "150", "--threshold",
                        "200", "--sigma", "40", "--answered", str(mask_path), "--insecure-noise-seed", "3", "--json")
    assert code == 0
    report = strict_json(out)
    mechanism = build_mechanism("confident-gnmax", sigma1=150.0, threshold=200.0, sigma=40.0)
    smooth = SmoothSensitivityParameters.for_workload(mechanism.run_charge(60, 60), 1e-5)
    expected = analysis_report(mechanism, votes, answered, 1e-5, smooth=smooth,
                               noise=NoisePolicy(insecure_seed=3)).as_dict()
    assert report["guarantee"]["epsilon"] == pytest.approx(expected["guarantee"]["epsilon"])
    assert [e["epsilon"] for e in report["estimates"]] == pytest.approx([e["epsilon"] for e in expected["estimates"]])
    assert report["sound"] is False and "insecure_noise_seed=3" in report["unsound_reasons"][0]


def test_a_budget_states_the_filters_guarantee_and_whether_the_run_fits(run_files, capsys):
    votes_path, mask_path, _, answered = run_files
    base = [str(votes_path), "--mechanism", "gnmax", "--sigma", "40", "--no-smooth-sensitivity", "--json"]
    code, out, _ = call(capsys, *base)
    worst = strict_json(out)["guarantee"]["epsilon"]
    code, out, _ = call(capsys, *base, "--budget", f"{2 * worst}")
    roomy = strict_json(out)
    assert code == 0 and roomy["budget"]["fits"] is True and roomy["guarantee"]["epsilon"] == pytest.approx(worst)
    code, out, _ = call(capsys, *base, "--budget", f"{worst / 3}")
    over = strict_json(out)
    assert over["budget"]["fits"] is False and over["guarantee"]["basis"] == "worst-case"
    assert over["budget"]["order"] in DEFAULT_ORDERS.tolist()


def test_python_m_cluster_prints_a_short_summary_labelling_the_private_figure(run_files):
    votes_path, _, _, _ = run_files
    done = subprocess.run(
        [sys.executable, "-m", "cluster", "analyze", str(votes_path), "--mechanism", "gnmax", "--sigma", "40"],
        capture_output=True, text=True, timeout=120, cwd=PROJECT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert 3 <= len(lines) <= 6
    assert lines[0].startswith("gnmax: 60 queries, 60 answered")
    assert lines[1].strip().startswith("guarantee") and "worst-case" in lines[1]
    assert any("smooth-sensitivity" in line and "not a DP guarantee" in line for line in lines)
    assert any("data-dependent" in line and "PRIVATE" in line for line in lines)


def test_console_entry_rejects_bad_input_with_one_line_and_status_2(tmp_path):
    bad = tmp_path / "votes.npy"
    np.save(bad, np.array([[1.5, 2.0]]))
    done = run_cli(str(bad), "--mechanism", "gnmax", "--sigma", "40")
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "integer" in done.stderr


# --- in-process -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(prog="conclave analyze")
    analyze_command.add_arguments(result, "analyze")
    return result


def call(capsys, *argv: str) -> tuple[int, str, str]:
    code = analyze_command.main(parser().parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_orders_and_the_classic_conversion_change_the_estimates_only(run_files, capsys):
    votes_path, _, votes, _ = run_files
    base = [str(votes_path), "--mechanism", "gnmax", "--sigma", "40", "--orders", "2,8,32", "--delta", "1e-6",
            "--no-smooth-sensitivity", "--json"]
    code, out, _ = call(capsys, *base, "--conversion", "classic")
    assert code == 0
    classic = strict_json(out)
    (estimate,) = classic["estimates"]
    assert estimate["conversion"] == "classic" and estimate["order"] in (2.0, 8.0, 32.0)
    rdp = build_mechanism("gnmax", sigma=40.0).data_dependent_rdp(votes, np.ones(60, bool), np.array([2.0, 8.0, 32.0]))
    assert estimate["epsilon"] == pytest.approx(np.min(rdp.sum(axis=0) + math.log(1e6) / (np.array([2.0, 8.0, 32.0]) - 1)))
    code, out, _ = call(capsys, *base)
    tight = strict_json(out)
    assert tight["estimates"][0]["epsilon"] < estimate["epsilon"]  # the tight default
    # the guarantee stays on the ledger's grid, tight conversion, whatever --orders says
    assert tight["guarantee"] == classic["guarantee"]
    assert tight["guarantee"]["epsilon"] == pytest.approx(
        epsilon_from_rdp(DEFAULT_ORDERS, 60 * DEFAULT_ORDERS / 1600, 1e-6)[0])


def test_nzc_json_is_unbounded_with_the_claim_beside_it(run_files, capsys):
    votes_path, _, _, _ = run_files
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "nzc", "--constant", "1e100", "--laplace-scale", "1e10", "--json")
    assert code == 0
    report = strict_json(out)
    assert report["sound"] is False and report["unsound_reasons"]
    assert report["guarantee"]["epsilon"] == "inf" and report["guarantee"]["basis"] == "unbounded"
    (claim,) = report["estimates"]
    assert claim["name"] == "paper-claim" and claim["epsilon_per_query"] == pytest.approx(2e-10)
    assert "NOT" in claim["source"]
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "nzc", "--constant", "1e100", "--laplace-scale", "1e10")
    assert "inf" in out and "not a DP guarantee" in out  # never the claim alone


def test_stability_reports_its_epsilon_delta(run_files, capsys):
    votes_path, _, _, _ = run_files
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "stability", "--epsilon", "2", "--max-unstable", "20",
                        "--stability-delta", "1e-6", "--json")
    assert code == 0
    report = strict_json(out)
    assert report["guarantee"]["epsilon"] == pytest.approx(2.0, abs=1e-3) and report["guarantee"]["delta"] == 1e-5
    assert report["mechanism"]["parameters"]["delta"] == 1e-6


def bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "float": np.array([[1.5, 2.0], [3.0, 1.0]]),
        "negative": np.array([[3, -1], [2, 2]]),
        "empty": np.zeros((0, 3), dtype=np.int64),
        "flat": np.array([3, 1, 0]),
        "good": np.array([[3, 1, 0], [2, 2, 0]]),
        "mask_short": np.array([True]),
        "mask_int": np.array([1, 0]),
    }
    paths = {}
    for name, array in files.items():
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], array)
    paths["garbage"] = tmp_path / "garbage.npy"
    paths["garbage"].write_bytes(b"not a numpy file")
    paths["missing"] = tmp_path / "does-not-exist.npy"
    return paths


@pytest.mark.parametrize(
    "argv,words",
    [
        (["{float}", "--mechanism", "gnmax", "--sigma", "40"], "integer"),
        (["{negative}", "--mechanism", "gnmax", "--sigma", "40"], "non-negative"),
        (["{empty}", "--mechanism", "gnmax", "--sigma", "40"], "empty"),
        (["{flat}", "--mechanism", "gnmax", "--sigma", "40"], "2-D"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--answered", "{mask_short}"], "shape"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--answered", "{mask_int}"], "boolean"),
        (["{good}", "--mechanism", "gnmax"], "--sigma"),
        (["{good}", "--mechanism", "lnmax"], "--laplace-scale"),
        (["{good}", "--mechanism", "confident-gnmax", "--sigma1", "150", "--sigma", "40"], "--threshold"),
        (["{good}", "--mechanism", "nzc", "--constant", "100"], "--laplace-scale or --sigma"),
        (["{good}", "--mechanism", "stability", "--epsilon", "1"], "--max-unstable"),
        (["{good}", "--mechanism", "stability", "--epsilon", "1", "--max-unstable", "3"], "--stability-delta"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--budget", "-1"], "--budget"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--ss-order", "9"], "go together"),
        (["{good}", "--mechanism", "lnmax", "--laplace-scale", "20", "--sigma", "3"], "does not take"),
        (["{garbage}", "--mechanism", "gnmax", "--sigma", "40"], "cannot read"),
        (["{missing}", "--mechanism", "gnmax", "--sigma", "40"], "cannot read"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--answered", "{missing}"], "cannot read"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--orders", "0.5,2"], "--orders"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--orders", "two"], "--orders"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "40", "--delta", "2"], "--delta"),
        (["{good}", "--mechanism", "gnmax", "--sigma", "-1"], "sigma"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_status_2(tmp_path, capsys, argv, words):
    paths = bad_files(tmp_path)
    code, out, err = call(capsys, *[a.format(**paths) for a in argv])
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert words in err
