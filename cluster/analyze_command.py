"""``conclave analyze VOTES.npy``: what answering these teacher vote histograms costs in privacy.

Pure numpy/scipy (no torch, no Ray): it loads the histograms, builds the mechanism with the
same names the aggregator uses, and prints ``privacy.accounting.pate.privacy_report`` —
one JSON object with ``--json``, a short summary otherwise. Bad input is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from privacy.accounting.pate import privacy_report
from privacy.mechanisms import build_mechanism
from privacy.randomness import make_rng

EXIT_BAD_INPUT = 2

# the flags each mechanism cannot do without (NZC needs one of two noise flags)
_REQUIRED = {
    "lnmax": ("laplace_scale",),
    "gnmax": ("sigma",),
    "confident-gnmax": ("sigma1", "threshold", "sigma"),
    "nzc": ("constant",),
    "stability": ("epsilon", "max_unstable"),
}
_MECHANISM_FLAGS = ("sigma", "sigma1", "threshold", "laplace_scale", "constant", "epsilon", "max_unstable", "max_queries")


class BadInput(Exception):
    """Input the command refuses; the message is printed as the one-line error."""


def add_arguments(parser: argparse.ArgumentParser, command: str = "analyze") -> None:
    parser.add_argument("votes", metavar="VOTES.npy", help="integer array [queries, classes] of teacher votes")
    parser.add_argument("--mechanism", required=True, choices=sorted(_REQUIRED), help="the aggregation mechanism")
    parser.add_argument("--sigma", type=float, help="GNMax noise sigma (sigma2, after the threshold, for confident-gnmax)")
    parser.add_argument("--sigma1", type=float, help="confident-gnmax: noise sigma of the threshold check")
    parser.add_argument("--threshold", type=float, help="confident-gnmax: threshold T on the top count")
    parser.add_argument("--laplace-scale", type=float, help="Laplace scale b (the papers' 1/gamma)")
    parser.add_argument("--constant", type=float, help="nzc: the constant c added to the top count")
    parser.add_argument("--epsilon", type=float, help="stability: the run's epsilon")
    parser.add_argument("--max-unstable", type=int, help="stability: cap on abstentions (unstable queries)")
    parser.add_argument("--max-queries", type=int, help="stability: cap on queries (default: the mechanism's)")
    parser.add_argument("--answered", metavar="MASK.npy", help="boolean array [queries]: which queries were answered")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--orders", help="comma-separated RDP orders > 1, replacing the default grid")
    parser.add_argument(
        "--conversion", choices=("tight", "classic"), default="tight",
        help="RDP to (eps, delta): tight (Balle et al. 2020, as the ledger) or classic (as the PATE papers)",
    )
    parser.add_argument("--seed", type=int, help="seed for the smooth-sensitivity release noise (default: OS entropy)")
    parser.add_argument("--ss-order", type=float, help="order of the smooth-sensitivity release (default: tuned on the votes)")
    parser.add_argument("--ss-beta", type=float, help="beta of the smooth-sensitivity release (with --ss-sigma)")
    parser.add_argument("--ss-sigma", type=float, help="sigma_ss of the smooth-sensitivity release (with --ss-beta)")
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
    missing = [name for name in _REQUIRED[args.mechanism] if getattr(args, name) is None]
    if args.mechanism == "nzc" and args.laplace_scale is None and args.sigma is None:
        missing.append("laplace_scale or sigma")
    if missing:
        flags = ", ".join("--" + m.replace("_", "-").replace(" or ", " or --") for m in missing)
        raise BadInput(f"--mechanism {args.mechanism} needs {flags}")
    params = {name: getattr(args, name) for name in _MECHANISM_FLAGS if getattr(args, name) is not None}
    if args.mechanism == "stability":
        params["delta"] = args.delta
    try:
        return build_mechanism(args.mechanism, **params)
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


def _order(value: float | None) -> str:
    return "" if value is None else f"  (order {value:g})"


def summary(report: dict) -> str:
    """A few lines a person can read; the data-dependent figure is always labelled private."""
    head = (
        f"{report['mechanism']}: {report['queries']} queries, {report['answered']} answered, "
        f"{report['classes']} classes, {report['teachers']} teachers; delta={report['delta']:g}, "
        f"{report['conversion']} conversion"
    )
    lines = [head]
    if report["mechanism"] == "nzc":
        claim = report["claimed"]
        lines += [
            "  sound epsilon         = inf  (no finite differential-privacy guarantee)",
            f"  why: {report['reason']}",
            f"  paper's claim (NOT a DP guarantee): epsilon = {claim['epsilon_total']:.4g} "
            f"({claim['epsilon_per_query']:.4g} per query; {claim['source']})",
        ]
        return "\n".join(lines)
    if report["mechanism"] == "stability":
        lines.append(
            f"  (epsilon, delta)      = ({report['epsilon_data_independent']:.4g}, {report['delta']:g})  "
            "for the whole run (sparse-vector stability, Bassily et al. 2018)"
        )
        return "\n".join(lines)
    lines.append(
        f"  data-independent      epsilon = {report['epsilon_data_independent']:.4f}"
        f"{_order(report['order_data_independent'])}  publishable"
    )
    release = report["smooth_sensitivity"]
    if release.get("available"):
        lines.append(
            f"  smooth-sensitivity    epsilon = {report['epsilon_smooth_sensitivity']:.4f}  (order {release['order']:g}, "
            f"beta {release['beta']:.4g}, sigma_ss {release['sigma_ss']:.4g}, noise std {release['noise_std']:.3g})  "
            "publishable: the data-dependent cost, privatized"
        )
    else:
        lines.append(f"  smooth-sensitivity    not available: {release.get('reason', '')}")
    lines.append(
        f"  data-dependent        epsilon = {report['epsilon_data_dependent']:.4f}"
        f"{_order(report['order_data_dependent'])}  PRIVATE: computed from the votes, do not publish"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        if not 0 < args.delta < 1:
            raise BadInput(f"--delta must be in (0, 1), got {args.delta}")
        if (args.ss_beta is None) != (args.ss_sigma is None):
            raise BadInput("--ss-beta and --ss-sigma go together")
        orders = _parse_orders(args.orders)
        mechanism = _mechanism(args)
        votes = _load(args.votes, "votes")
        answered = None if args.answered is None else _load(args.answered, "answered mask")
        try:
            report = privacy_report(
                mechanism, votes, answered, args.delta, orders=orders, conversion=args.conversion,
                rng=make_rng(args.seed), ss_order=args.ss_order, ss_beta=args.ss_beta, ss_sigma=args.ss_sigma,
            )
        except ValueError as error:
            raise BadInput(str(error)) from None
    except BadInput as error:
        print(f"conclave analyze: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(_jsonable(report)))
    else:
        print(summary(report))
    return 0
