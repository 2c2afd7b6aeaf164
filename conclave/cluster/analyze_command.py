"""``conclave analyze VOTES.npy``: what answering these teacher vote histograms costs in privacy.

Pure numpy/scipy (no torch, no Ray): it loads the histograms, builds the mechanism with the
same names the aggregator uses, and prints ``privacy.accounting.report.analysis_report`` —
one JSON object with ``--json``, a short summary otherwise. The report's ``guarantee`` is
the worst case of the file's queries (every one answered), or with ``--ledger PATH`` the
budget that the run which answered them declared in its ledger (read without writing, and
checked against the votes: ``report.ledger_checks``). ``--budget EPS`` is only a check,
labelled "would-have-fitted": a number typed afterwards was not a filter in force while the
answers were released, so it never becomes the guarantee. Data-dependent figures are
``estimates``. Bad input is one line on stderr and exit status 2.

The mechanism flags come from the mechanisms' own registry (``privacy.mechanisms``): every
constructor argument is a flag of the same name, except arguments that clash with this
command's own flags (a mechanism's ``delta`` is ``--<mechanism>-delta``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import Any

import numpy as np

from conclave.errors import ConclaveError, fail
from conclave.privacy.accounting.ledger import LedgerSnapshot, read_ledger
from conclave.privacy.accounting.report import analysis_report, checked_votes
from conclave.privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from conclave.privacy.mechanisms import MECHANISMS, build_mechanism, parameter_names
from conclave.privacy.noise import NoisePolicy

_OWN_FLAGS = {"delta", "orders", "conversion", "budget", "ledger", "answered", "json"}
DEFAULT_DELTA = 1e-5


class BadInput(ConclaveError):
    """Input the command refuses; the message is printed as the one-line error."""

    exit_code = 2


def _flag_name(mechanism: str, parameter: str) -> str:
    """The command-line flag of a constructor argument (without the dashes)."""
    name = f"{mechanism}_{parameter}" if parameter in _OWN_FLAGS else parameter
    return name.replace("_", "-")


def _mechanism_flags() -> dict[str, tuple[type, str]]:
    """flag (dashed) → (type, help), over every registered mechanism's parameters and aliases."""
    flags: dict[str, tuple[type, str]] = {}
    for name, cls in MECHANISMS.items():
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for given, argument in parameter_names(name).items():
            kind = int if fields[argument].type in ("int", "int | None") else float
            flag = _flag_name(name, given)
            text = f"{name}: {cls.help.get(argument, argument)}"
            flags[flag] = (kind, f"{flags[flag][1]}; {text}" if flag in flags else text)
    return flags


def add_arguments(parser: argparse.ArgumentParser, command: str = "analyze") -> None:
    parser.add_argument("votes", metavar="VOTES.npy", help="integer array [queries, classes] of teacher votes")
    parser.add_argument("--mechanism", required=True, choices=sorted(MECHANISMS), help="the aggregation mechanism")
    for flag, (kind, help_text) in _mechanism_flags().items():
        parser.add_argument(f"--{flag}", type=kind, help=help_text)
    parser.add_argument("--answered", metavar="MASK.npy", help="boolean array [queries]: which queries were answered")
    parser.add_argument("--delta", type=float,
                        help=f"target delta (default: the ledger's with --ledger, else {DEFAULT_DELTA:g})")
    parser.add_argument("--ledger", metavar="PATH",
                        help="the privacy ledger of the run that answered these votes, read without writing: "
                             "when it declared a budget (a Rényi filter in force while it answered) and its charges "
                             "match the votes, that budget is the guarantee")
    parser.add_argument("--budget", type=float, metavar="EPS",
                        help="a check, never the guarantee: whether a Rényi filter declared at EPS before the run "
                             "would have admitted these answers (no filter was in force; see --ledger)")
    parser.add_argument("--orders", help="comma-separated RDP orders > 1 for the estimates (the guarantee always "
                                         "uses the ledger's grid)")
    parser.add_argument(
        "--conversion", choices=("tight", "classic"), default="tight",
        help="RDP to (eps, delta) for the estimates: tight (Balle et al. 2020) or classic (as the PATE papers)",
    )
    parser.add_argument("--no-smooth-sensitivity", action="store_true",
                        help="skip the smooth-sensitivity release of the data-dependent cost (GNMax family)")
    parser.add_argument("--ss-order", type=float, help="order of the smooth-sensitivity release "
                                                       "(default: from the planned worst case, never from the votes)")
    parser.add_argument("--ss-beta", type=float, help="beta of the smooth-sensitivity release (with --ss-order)")
    parser.add_argument("--ss-sigma", type=float, help="sigma_ss of the smooth-sensitivity release (with --ss-order)")
    parser.add_argument("--insecure-noise-seed", type=int, metavar="N",
                        help="draw the release's noise from this public seed (debugging only: the report is "
                             "marked unsound)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _load(path: str, what: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise BadInput(f"cannot read {what} {path!r}: {error}") from None


def _parse_orders(text: str | None) -> np.ndarray | None:
    if text is None:
        return None
    try:
        orders = np.array([float(part) for part in text.split(",") if part.strip()])
    except ValueError:
        raise BadInput(f"--orders must be comma-separated numbers, got {text!r}") from None
    if orders.size == 0 or not np.all(np.isfinite(orders)) or np.any(orders <= 1):
        raise BadInput(f"--orders must be numbers > 1, got {text!r}")
    return orders


def _mechanism(args: argparse.Namespace):
    name = args.mechanism
    accepted = parameter_names(name)
    params = {given: getattr(args, _flag_name(name, given).replace("-", "_")) for given in accepted}
    foreign = sorted(flag for flag in _mechanism_flags()
                     if getattr(args, flag.replace("-", "_")) is not None
                     and flag not in {_flag_name(name, given) for given in accepted})
    if foreign:
        raise BadInput(f"--mechanism {name} does not take {', '.join('--' + f for f in foreign)}")
    try:
        return build_mechanism(name, **params)
    except ValueError as error:
        raise BadInput(_as_flags(name, str(error))) from None


def _as_flags(name: str, message: str) -> str:
    """A mechanism's error with its argument names written as this command's flags."""
    flags = {argument: given for given, argument in parameter_names(name).items() if given != argument}
    for argument in sorted(parameter_names(name).values(), key=len, reverse=True):
        flag = "--" + _flag_name(name, flags.get(argument, argument))
        message = re.sub(rf"(?<![\w-]){re.escape(argument)}(?![\w-])", flag, message)
    return message


def _ledger(args: argparse.Namespace) -> LedgerSnapshot | None:
    if args.ledger is None:
        return None
    if args.budget is not None:
        raise BadInput("--budget cannot go with --ledger: the ledger's declared budget is the guarantee, "
                       "--budget is a would-have-fitted check for votes answered without one")
    if any(v is not None for v in (args.ss_order, args.ss_beta, args.ss_sigma)):
        raise BadInput("--ledger cannot go with --ss-order/--ss-beta/--ss-sigma: a smooth-sensitivity release made "
                       "here is not paid for by the run's ledger")
    try:
        ledger = read_ledger(args.ledger)
    except (OSError, ValueError) as error:
        raise BadInput(f"--ledger: {error}") from None
    if args.delta is not None and args.delta != ledger.delta:
        raise BadInput(f"--delta {args.delta:g} differs from the ledger's delta {ledger.delta:g}")
    return ledger


def _smooth(args: argparse.Namespace, mechanism, queries: int, delta: float) -> SmoothSensitivityParameters | None:
    fixed = (args.ss_order, args.ss_beta, args.ss_sigma)
    if args.ledger is not None:
        return None  # the run's ledger did not pay for a new release (``_ledger`` refused --ss-*)
    if args.no_smooth_sensitivity:
        if any(v is not None for v in fixed):
            raise BadInput("--no-smooth-sensitivity cannot go with --ss-order/--ss-beta/--ss-sigma")
        return None
    if not mechanism.smooth_sensitivity_analysis:
        return None
    try:
        if all(v is None for v in fixed):
            return SmoothSensitivityParameters.for_workload(mechanism.run_charge(queries, queries), delta)
        if any(v is None for v in fixed):
            raise BadInput("--ss-order, --ss-beta and --ss-sigma go together")
        return SmoothSensitivityParameters(*fixed)
    except ValueError as error:
        raise BadInput(str(error)) from None


def _jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become the strings "inf" / "-inf" / "nan" (as results/ files)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        if math.isfinite(value):
            return value
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def summary(report: dict) -> str:
    """A few lines a person can read: the guarantee first, every estimate labelled as one."""
    head = (f"{report['mechanism']['name']}: {report['queries']} queries, {report['answered']} answered, "
            f"{report['classes']} classes, {report['teachers']} teachers")
    guarantee = report["guarantee"]
    epsilon = guarantee["epsilon"]
    lines = [head, f"  guarantee   epsilon = {_number(epsilon)} at delta = {guarantee['delta']:g}  "
                   f"({guarantee['basis']}; {guarantee['neighbouring_means']})"]
    if guarantee["unsound_reasons"]:
        lines.append("    NOT SOUND: " + "; ".join(guarantee["unsound_reasons"]))
    ledger = report.get("ledger")
    if ledger:
        lines.append(f"    from ledger {ledger['path']}: the budget its run declared, "
                     "a filter in force while it answered")
        lines.append("    checked: " + "; ".join(ledger["checked"]))
        lines.append("    not checked: " + ledger["not_checked"])
    check = report.get("budget_check")
    if check:
        lines.append(f"  check       {check['kind']}: {check['statement']}  — {check['label']} "
                     f"(no filter was in force)")
    for estimate in report["estimates"]:
        value = estimate["epsilon"]
        text = (f"epsilon = {_number(value)}" if value is not None
                else f"not available: {estimate.get('reason', '')}")
        where = f" (order {estimate['order']:g})" if estimate.get("order") else ""
        private = "  PRIVATE: computed from the votes, do not publish" if estimate["private"] else ""
        lines.append(f"  estimate    {estimate['name']:<19} {text}{where}  — not a DP guarantee{private}")
    return "\n".join(lines)


def _number(value: float | str) -> str:
    return "inf (no finite guarantee)" if value in (math.inf, "inf") else f"{float(value):.4f}"


def main(args: argparse.Namespace) -> int:
    try:
        if args.delta is not None and not 0 < args.delta < 1:
            raise BadInput(f"--delta must be in (0, 1), got {args.delta}")
        if args.budget is not None and not (args.budget > 0 and math.isfinite(args.budget)):
            raise BadInput(f"--budget must be a finite epsilon > 0, got {args.budget}")
        orders = _parse_orders(args.orders)
        mechanism = _mechanism(args)
        ledger = _ledger(args)
        delta = ledger.delta if ledger is not None else (DEFAULT_DELTA if args.delta is None else args.delta)
        votes = _load(args.votes, "votes")
        answered = None if args.answered is None else _load(args.answered, "answered mask")
        noise = NoisePolicy(insecure_seed=args.insecure_noise_seed)
        try:
            votes, answered = checked_votes(votes, answered)
            smooth = _smooth(args, mechanism, len(votes), delta)
            report = analysis_report(mechanism, votes, answered, delta, ledger=ledger, budget_check=args.budget,
                                     smooth=smooth, noise=noise, conversion=args.conversion, orders=orders)
        except ValueError as error:
            raise BadInput(str(error)) from None
    except BadInput as error:
        return fail(error, "conclave analyze: error")
    full = _jsonable(report.as_dict(include_private=True))  # the data holder's own view
    print(json.dumps(full) if args.json else summary(full))
    return 0
