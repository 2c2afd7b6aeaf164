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

from conclave.cluster import analyze_command
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import filter_for
from conclave.privacy.accounting.ledger import PrivacyLedger, read_ledger
from conclave.privacy.accounting.pld import analytic_gaussian_epsilon
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_charge
from conclave.privacy.accounting.report import analysis_report, planned_charge
from conclave.privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from conclave.privacy.mechanisms import build_mechanism
from conclave.privacy.mechanisms.base import ABSTAIN, VoteMechanism
from conclave.privacy.noise import NoisePolicy

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


@pytest.fixture(scope="module")
def processes(run_files, tmp_path_factory) -> dict[str, subprocess.Popen]:
    """This file's three real processes, started together: each spends its time importing, and
    side by side they take two cores where one after the other they would leave one idle."""
    votes_path, mask_path, _, _ = run_files
    bad = tmp_path_factory.mktemp("bad") / "votes.npy"
    np.save(bad, np.array([[1.5, 2.0]]))
    confident = ["--mechanism", "confident-gnmax", "--sigma1", "150", "--threshold", "200", "--sigma", "40"]
    commands = {
        "json": [str(CONCLAVE), "analyze", str(votes_path), *confident, "--answered", str(mask_path), "--json"],
        "python -m": [sys.executable, "-m", "conclave", "analyze", str(votes_path), "--mechanism", "gnmax",
                      "--sigma", "40"],
        "bad input": [str(CONCLAVE), "analyze", str(bad), "--mechanism", "gnmax", "--sigma", "40"],
    }
    started = {name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=PROJECT)
               for name, command in commands.items()}
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_console_entry_prints_the_report_as_one_json_object(run_files, processes):
    votes_path, mask_path, votes, answered = run_files
    done = finished(processes["json"])
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


def test_a_budget_is_a_labelled_would_have_fitted_check_never_the_guarantee(run_files, capsys):
    votes_path, mask_path, _, answered = run_files
    base = [str(votes_path), "--mechanism", "gnmax", "--sigma", "40", "--no-smooth-sensitivity", "--json"]
    code, out, _ = call(capsys, *base)
    worst = strict_json(out)["guarantee"]
    for budget, fits in ((2 * worst["epsilon"], True), (worst["epsilon"] / 3, False)):
        code, out, _ = call(capsys, *base, "--budget", f"{budget}")
        report = strict_json(out)
        assert code == 0 and report["guarantee"] == worst  # the check never changes the guarantee
        check = report["budget_check"]
        assert check["kind"] == "would-have-fitted" and check["label"] == "check: not a DP guarantee"
        assert check["fits"] is fits and check["epsilon"] == budget and check["order"] in DEFAULT_ORDERS.tolist()
        assert ("would have admitted" if fits else "would NOT have admitted") in check["statement"]
        assert "renyi-filter" not in out and "budget" not in report
    # Fewer answered than the worst case: the answers fit a budget below the worst case, and
    # the guarantee still is the worst case (it used to say "renyi-filter" here).
    cgnmax = [str(votes_path), "--mechanism", "confident-gnmax", "--sigma1", "150", "--threshold", "200",
              "--sigma", "40", "--answered", str(mask_path), "--no-smooth-sensitivity"]
    code, out, _ = call(capsys, *cgnmax, "--json")
    worst = strict_json(out)["guarantee"]
    code, out, _ = call(capsys, *cgnmax, "--budget", f"{0.95 * worst['epsilon']}", "--json")
    report = strict_json(out)
    assert answered.sum() < 60 and report["budget_check"]["fits"] is True
    assert report["guarantee"] == worst and "renyi-filter" not in out
    code, out, _ = call(capsys, *cgnmax, "--budget", f"{0.95 * worst['epsilon']}")
    assert "renyi-filter" not in out and "(worst-case;" in out
    (line,) = [line for line in out.splitlines() if "would-have-fitted" in line]
    assert line.strip().startswith("check") and "would have admitted" in line and "not a DP guarantee" in line


# --- votes answered by a run, with the run's ledger -------------------------------------------

LEMMA = "test: each record is in one teacher's shard"
SETTINGS = ["--mechanism", "confident-gnmax", "--sigma1", "150", "--threshold", "200", "--sigma", "40"]


def answered_by_a_run(folder: Path, votes: np.ndarray, epsilon: float | None,
                      mechanism: VoteMechanism | None = None) -> tuple[Path, Path, Path]:
    """What a labelling service leaves behind: its ledger (a filter at ``epsilon`` declared before
    the first query, or record-only), charged before each batch is released with the answers,
    as ``actors.labeller`` does; and the votes it answered with the mask of released answers."""
    mechanism = mechanism or build_mechanism("confident-gnmax", sigma1=150.0, threshold=200.0, sigma=40.0)
    planned = planned_charge(mechanism, len(votes)).for_records(Neighbouring.ADD_REMOVE, LEMMA)
    budget = None if epsilon is None else filter_for(planned, epsilon, 1e-5)
    rng = np.random.default_rng(2)  # a test's stand-in: a service draws from OS entropy
    released = []
    with PrivacyLedger(folder / "ledger.sqlite", 1e-5, budget) as ledger:
        # another release of the run (the smooth-sensitivity reservation): its own label
        ledger.charge(gaussian_charge(200.0, label="smooth-sensitivity", neighbouring=Neighbouring.ADD_REMOVE))
        for start in range(0, len(votes), 16):
            result = mechanism(votes[start:start + 16], rng)
            answers = {f"input-{start + row}".encode(): label for row, label in enumerate(result.labels.tolist())}
            if result.charge.is_free:  # inside an open stability run, paid for when it opened
                ledger.answers.record(answers)
            else:
                ledger.charge(result.charge.for_records(Neighbouring.ADD_REMOVE, LEMMA), answers=answers)
            result.commit()
            released.append(result.labels != ABSTAIN)
    np.save(folder / "votes.npy", votes)
    np.save(folder / "answered.npy", np.concatenate(released))
    return folder / "ledger.sqlite", folder / "votes.npy", folder / "answered.npy"


@pytest.fixture()
def filtered_run(run_files, tmp_path) -> tuple[Path, Path, Path]:
    return answered_by_a_run(tmp_path, run_files[2], epsilon=6.0)


def test_a_filtered_runs_ledger_states_its_declared_budget_as_the_guarantee(filtered_run, capsys):
    ledger_path, votes_path, mask_path = filtered_run
    before = ledger_path.read_bytes()
    argv = [str(votes_path), *SETTINGS, "--answered", str(mask_path), "--ledger", str(ledger_path)]
    code, out, err = call(capsys, *argv, "--json")
    assert code == 0, err
    report = strict_json(out)
    declared = read_ledger(ledger_path).budget
    guarantee = report["guarantee"]
    assert guarantee["basis"] == "renyi-filter" and guarantee["neighbouring"] == Neighbouring.ADD_REMOVE
    assert (guarantee["epsilon"], guarantee["delta"], guarantee["order"]) == (6.0, 1e-5, declared.order)
    assert report["sound"] is True and "budget_check" not in report
    ledger = report["ledger"]
    assert ledger["path"] == str(ledger_path) and ledger["declared"]["epsilon"] == 6.0
    assert ledger["charges"] == 1 + 4 and ledger["answers"] == 60 and len(ledger["checked"]) == 4
    assert "histograms" in ledger["not_checked"] and "unedited" in ledger["not_checked"]
    # no new release the ledger did not pay for: only the private data-dependent estimate
    assert [e["name"] for e in report["estimates"]] == ["data-dependent"]
    code, out, _ = call(capsys, *argv)
    lines = out.splitlines()
    assert "(renyi-filter;" in lines[1] and "epsilon = 6.0000" in lines[1]
    assert f"from ledger {ledger_path}" in lines[2] and lines[3].strip().startswith("checked:")
    assert lines[4].strip().startswith("not checked:")
    assert ledger_path.read_bytes() == before  # read without writing


def test_a_record_only_runs_ledger_is_refused(run_files, tmp_path, capsys):
    ledger_path, votes_path, mask_path = answered_by_a_run(tmp_path, run_files[2], epsilon=None)
    code, out, err = call(capsys, str(votes_path), *SETTINGS, "--answered", str(mask_path),
                          "--ledger", str(ledger_path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "declares no budget" in err and "no filter was in force" in err


@pytest.mark.parametrize(
    "change,words",
    [
        (["--sigma", "30"], "not what these mechanism settings charge"),  # other mechanism settings
        (["--answered", None], "not what these mechanism settings charge"),  # every query taken as answered
        (["--votes", "first-48"], "charge for 48 queries with"),  # part of the run's votes
        (["--mechanism", "gnmax"], "no 'gnmax' charges"),
        (["--budget", "3"], "--budget cannot go with --ledger"),
        (["--ss-order", "9"], "--ledger cannot go with --ss-order"),
        (["--delta", "1e-6"], "differs from the ledger's delta 1e-05"),
        (["--ledger", "missing"], "no privacy ledger at"),
        (["--ledger", "garbage"], "is not a privacy ledger"),
    ],
)
def test_a_ledger_that_does_not_match_the_votes_is_refused(filtered_run, tmp_path, capsys, change, words):
    ledger_path, votes_path, mask_path = filtered_run
    options = {"--votes": str(votes_path), "--mechanism": "confident-gnmax", "--sigma1": "150", "--threshold": "200",
               "--sigma": "40", "--answered": str(mask_path), "--ledger": str(ledger_path)}
    flag, value = change
    if value == "first-48":
        value = str(tmp_path / "first.npy")
        np.save(value, np.load(votes_path)[:48])
        options["--answered"] = str(tmp_path / "first-mask.npy")
        np.save(options["--answered"], np.load(mask_path)[:48])
    elif flag == "--mechanism":
        options = {k: v for k, v in options.items() if k not in ("--sigma1", "--threshold")}
    elif value == "missing":
        value = str(tmp_path / "no-ledger.sqlite")
    elif value == "garbage":
        value = str(tmp_path / "garbage.sqlite")
        Path(value).write_bytes(b"not a ledger" * 100)
    options[flag] = value
    votes = options.pop("--votes")
    argv = [votes, *[part for key, v in options.items() if v is not None for part in (key, v)]]
    code, out, err = call(capsys, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert words in err
    assert not (tmp_path / "no-ledger.sqlite").exists()  # a missing ledger is not created


def test_python_m_conclave_prints_a_short_summary_labelling_the_private_figure(processes):
    done = finished(processes["python -m"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert 3 <= len(lines) <= 6
    assert lines[0].startswith("gnmax: 60 queries, 60 answered")
    assert lines[1].strip().startswith("guarantee") and "worst-case" in lines[1]
    assert any("smooth-sensitivity" in line and "not a DP guarantee" in line for line in lines)
    assert any("data-dependent" in line and "PRIVATE" in line for line in lines)


def test_console_entry_rejects_bad_input_with_one_line_and_status_2(processes):
    done = finished(processes["bad input"])
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "integer" in done.stderr


def test_a_ledger_with_another_number_of_answers_is_refused(run_files, tmp_path, capsys):
    # The stability mechanism pays once for its whole run: only the recorded answers tell 48 from 60.
    mechanism = build_mechanism("stability", epsilon=2.0, max_unstable=20, delta=1e-6)
    ledger_path, votes_path, _ = answered_by_a_run(tmp_path, run_files[2], epsilon=6.0, mechanism=mechanism)
    settings = ["--mechanism", "stability", "--epsilon", "2", "--max-unstable", "20", "--stability-delta", "1e-6",
                "--ledger", str(ledger_path), "--json"]
    code, out, err = call(capsys, str(votes_path), *settings)
    assert code == 0, err
    assert strict_json(out)["guarantee"]["basis"] == "renyi-filter"
    np.save(tmp_path / "first.npy", run_files[2][:48])
    code, out, err = call(capsys, str(tmp_path / "first.npy"), *settings)
    assert code == 2 and "records 60 released answers, the votes file has 48 queries" in err


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
    # the guarantee is the fixed plan's, whatever --orders and --conversion say: its Gaussians' exact
    # curve, below the RDP figure on the ledger's grid
    assert tight["guarantee"] == classic["guarantee"]
    assert tight["guarantee"]["epsilon"] == pytest.approx(analytic_gaussian_epsilon(40.0 / math.sqrt(2 * 60), 1e-6))
    assert tight["guarantee"]["epsilon"] < epsilon_from_rdp(DEFAULT_ORDERS, 60 * DEFAULT_ORDERS / 1600, 1e-6)[0]


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
