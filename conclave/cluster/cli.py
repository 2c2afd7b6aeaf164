"""``conclave``: one command, one subcommand per way of using the product.

Subcommands are imported lazily so that, e.g., ``conclave analyze`` (pure numpy) starts
without importing torch or Ray. Each command module exposes ``add_arguments(parser)`` and
``main(args) -> int``.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import ModuleType

import conclave
from conclave.cluster.signal_hold import signals_held
from conclave.errors import Interrupted
from conclave.learning.threads import share_cores
from conclave.registry import Registry

COMMANDS: Registry[ModuleType] = Registry.described("command", {
    "demo": ("conclave.cluster.run_command", "run the teacher/student demo on scikit-learn digits"),
    "run": ("conclave.cluster.run_command", "run a pipeline described by a YAML config"),
    "serve": ("conclave.cluster.serve_command", "train teachers and serve the gRPC aggregator"),
    "query": ("conclave.cluster.query_command", "ask a running aggregator to label inputs"),
    "analyze": ("conclave.cluster.analyze_command", "privacy cost of answering teacher vote histograms"),
    "plan": ("conclave.cluster.plan_command", "what a config's budget buys, before any data is read"),
    "audit": ("conclave.cluster.audit_command", "an empirical lower bound on a config's ε, from one run with canaries"),
    "budget": ("conclave.cluster.budget_command", "owners' lifetime budgets and runs' ledgers: spend and history"),
    "check-data": ("conclave.cluster.check_data_command", "an owner's look at its own data, run on its own node"),
    "owner": ("conclave.cluster.owner_command", "an owner's policy and gateway on its own node: init, raise, lower, show, serve"),
    "ray-certs": ("conclave.cluster.ray_certs_command", "certificates for Ray's TLS between the cluster's nodes"),
    "tune": ("conclave.tuning.command", "Ray Tune sweep described by a YAML config"),
})


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``selected``'s module is imported (the others just list their help)."""
    parser = argparse.ArgumentParser(prog="conclave", description="Private teacher/student learning on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {conclave.__version__} ({conclave.DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        help_text = COMMANDS.about(name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            module = COMMANDS.load(name)
            module.add_arguments(command_parser, name)
            command_parser.set_defaults(handler=module.main)
    return parser


# Ray's notice that token authentication is on (its 2.60 default), logged at every start: the
# docs say it once (docs/cluster-and-tuning.md); -v shows it again.
QUIETED = ("ray._private.authentication.authentication_token_setup",)


def _selected_command(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _import_from_working_directory() -> None:
    """Let a config's ``module:function`` model be found from where ``conclave`` is started,
    as ``python -m`` would: a console script puts only its own folder on ``sys.path``."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Loading the command's module, reading the arguments and setting up logging: a Ctrl-C acts
    # once they are done (cluster.signal_hold), with nothing to undo. It then lands as the hold
    # ends, before the command's own handling of Ctrl-C has begun: the same one line.
    try:
        with signals_held({signal.SIGINT}):
            share_cores()  # before any command imports torch
            _import_from_working_directory()
            args = build_parser(_selected_command(argv)).parse_args(argv)
            _log(args.verbose)
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("conclave: interrupted", file=sys.stderr)
        return Interrupted.exit_code


def _log(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not verbose:
        for name in QUIETED:
            logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
