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
from privacy.accounting import pate
from privacy.accounting.rdp import DEFAULT_ORDERS
from privacy.mechanisms import build_mechanism
from privacy.randomness import make_rng

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
    done = run_cli(str(votes_path), *args, "--answered", str(mask_path), "--seed", "3", "--json")
    assert done.returncode == 0, done.stderr
    report = strict_json(done.stdout)
    for key in (
        "mechanism", "queries", "answered", "delta", "orders", "rdp_data_independent", "rdp_data_dependent",
        "epsilon_data_independent", "epsilon_data_dependent", "sound", "epsilon_smooth_sensitivity",
    ):
        assert key in report
    assert report["mechanism"] == "confident-gnmax" and report["sound"] is True
    assert report["queries"] == 60 and report["answered"] == int(answered.sum())
    assert report["orders"] == DEFAULT_ORDERS.tolist()
    # the same numbers as the library with the same seed
    expected = pate.privacy_report(
        build_mechanism("confident-gnmax", sigma1=150.0, threshold=200.0, sigma=40.0), votes, answered, 1e-5,
        rng=make_rng(3),
    )
    assert report["rdp_data_dependent"] == pytest.approx(expected["rdp_data_dependent"])
    assert report["epsilon_data_independent"] == pytest.approx(expected["epsilon_data_independent"])
    assert report["epsilon_smooth_sensitivity"] == pytest.approx(expected["epsilon_smooth_sensitivity"])
    assert report["epsilon_data_dependent"] < report["epsilon_data_independent"]


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
    assert "data-independent" in done.stdout and "smooth-sensitivity" in done.stdout
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


def test_orders_replace_the_grid_and_classic_conversion_is_exposed(run_files, capsys):
    votes_path, _, _, _ = run_files
    code, out, _ = call(
        capsys, str(votes_path), "--mechanism", "gnmax", "--sigma", "40", "--orders", "2,8,32", "--conversion", "classic",
        "--delta", "1e-6", "--seed", "1", "--json",
    )
    assert code == 0
    report = strict_json(out)
    assert report["orders"] == [2.0, 8.0, 32.0] and report["conversion"] == "classic"
    rdp_ind = np.array(report["rdp_data_independent"])
    assert rdp_ind == pytest.approx(60 * np.array([2.0, 8.0, 32.0]) / 1600)
    classic = np.min(rdp_ind + math.log(1e6) / (np.array([2.0, 8.0, 32.0]) - 1))
    assert report["epsilon_data_independent"] == pytest.approx(classic)
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "gnmax", "--sigma", "40", "--orders", "2,8,32", "--delta", "1e-6", "--seed", "1", "--json")
    assert strict_json(out)["epsilon_data_independent"] < classic  # the tight default


def test_nzc_json_is_unbounded_with_the_claim_beside_it(run_files, capsys):
    votes_path, _, _, _ = run_files
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "nzc", "--constant", "1e100", "--laplace-scale", "1e10", "--json")
    assert code == 0
    report = strict_json(out)
    assert report["sound"] is False and report["reason"]
    assert report["epsilon_data_independent"] == "inf" and report["epsilon_data_dependent"] == "inf"
    assert report["claimed"]["epsilon_per_query"] == pytest.approx(2e-10)
    assert "NOT" in report["claimed"]["label"]
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "nzc", "--constant", "1e100", "--laplace-scale", "1e10")
    assert "inf" in out and "NOT a DP guarantee" in out  # never the claim alone


def test_stability_reports_its_epsilon_delta(run_files, capsys):
    votes_path, _, _, _ = run_files
    code, out, _ = call(capsys, str(votes_path), "--mechanism", "stability", "--epsilon", "2", "--max-unstable", "20", "--json")
    assert code == 0
    report = strict_json(out)
    assert report["epsilon_data_independent"] == pytest.approx(2.0) and report["delta"] == pytest.approx(1e-5)


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
