"""``conclave owner``: an owner's policy for its data, written and changed on its own node.

The owner decides what may be released from its data, not whoever writes a run's config. On the
owner's machine (the node whose Ray worker holds its data), ``conclave owner init NAME`` writes
its policy in that machine's Conclave folder (``$CONCLAVE_HOME/owners/NAME.policy.json``, the
folder the node's ``ray start`` sees): the lifetime budget, where its ledger lives, which
pipelines and mechanisms it admits, the most one run may plan to spend, and the paths of its
data. Every run's ledger actor on that node reads it there; a run's config may ask for less,
never more (``privacy.accounting.owner_policy``). ``raise`` and ``lower`` change the lifetime ε,
recorded as an entry of the owner's ledger with its time; ``show`` prints the policies and their
ledgers' spend; ``serve OWNER.yaml`` runs the owner's gateway (``cluster.gateway``) with its own
Ray until Ctrl-C or SIGTERM. Exit status 2 for anything refused, in one line.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from conclave.errors import InvalidValue

# What a policy can admit besides the vote mechanisms (``privacy.mechanisms.MECHANISMS``): the
# other releases a pipeline makes from an owner's data, by the names the pipelines ask with.
OTHER_RELEASES = {
    "dpsgd": "DP-SGD training (active_learning, sparse_finetune)",
    "dp-pca": "NearPrivate's DP-PCA (active_learning)",
    "noisy-counts": "NearPrivate's noisy support counts (active_learning)",
    "smooth-sensitivity": "the smooth-sensitivity release of a teacher/student run's data-dependent cost",
}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = actions.add_parser("init", help="write this owner's policy on this node",
                              description="Write NAME's policy on this node (run it on the owner's machine).")
    init.add_argument("name", help="the owner's name, as runs' configs name it")
    init.add_argument("--epsilon", type=float, required=True, help="lifetime ε for this data, over every run")
    init.add_argument("--delta", type=float, default=1e-5, help="lifetime δ (default 1e-5)")
    init.add_argument("--neighbouring", default="add-remove", help="neighbouring relation (default add-remove)")
    init.add_argument("--order", type=float, default=None,
                      help="the Rényi order of the lifetime filter (default: fixed by the first run's planned work)")
    init.add_argument("--reserved-delta", type=float, default=0.0,
                      help="part of δ for releases that spend δ outside their RDP curve (default 0)")
    init.add_argument("--ledger", type=Path, default=None,
                      help="the folder of its ledger on this node (default $CONCLAVE_HOME/owners)")
    init.add_argument("--pipelines", nargs="+", default=[], metavar="PIPELINE",
                      help="admit only these pipelines (default: any)")
    init.add_argument("--mechanisms", nargs="+", default=[], metavar="MECHANISM",
                      help="admit only releases through these (default: any)")
    init.add_argument("--max-run-epsilon", type=float, default=None,
                      help="refuse a run whose planned worst case passes this ε at the owner's δ (a floor on noise)")
    init.add_argument("--data", nargs="+", type=Path, default=[], metavar="PATH",
                      help="the owner's data on this node: a run naming it as another owner is refused")
    for action, verb in (("raise", "raise"), ("lower", "lower")):
        change = actions.add_parser(action, help=f"{verb} this owner's lifetime ε (recorded in its ledger)",
                                    description=f"{verb.capitalize()} NAME's lifetime ε on this node; the change is "
                                                "an entry of its ledger, with its time.")
        change.add_argument("name")
        change.add_argument("--epsilon", type=float, required=True, help="the new lifetime ε")
    show = actions.add_parser("show", help="this node's owner policies and their ledgers' spend")
    show.add_argument("names", nargs="*", help="owners to show (default: every policy on this node)")
    show.add_argument("--json", action="store_true", help="print JSON")
    serve = actions.add_parser("serve", help="run this owner's gateway: the one door a coordinator reaches it by",
                               description="Serve the owner protocol over mutual TLS for the owner OWNER.yaml "
                                           "declares, with its own Ray, under its policy on this machine.")
    serve.add_argument("declaration", type=Path, help="the owner's own file (docs/gateway.md)")


def main(args: argparse.Namespace) -> int:
    from conclave.privacy.accounting.ledger import LedgerDamaged, LedgerInUse
    from conclave.privacy.accounting.owner_policy import OwnerRefused

    try:
        return {"init": _init, "raise": _change, "lower": _change, "show": _show, "serve": _serve}[args.action](args)
    except (OwnerRefused, LedgerDamaged, LedgerInUse, ValueError, OSError) as err:
        text = str(err).strip()
        print(f"conclave: {text.splitlines()[0] if text else type(err).__name__}", file=sys.stderr)
        return OwnerRefused.exit_code


def _init(args: argparse.Namespace) -> int:
    from conclave.cluster.pipelines import PIPELINES
    from conclave.privacy.accounting.ledger_records import conclave_home
    from conclave.privacy.accounting.owner_policy import OwnerPolicy, write_policy
    from conclave.privacy.mechanisms import MECHANISMS

    _check_names("pipeline", args.pipelines, list(PIPELINES))
    _check_names("mechanism", args.mechanisms, [*MECHANISMS, *OTHER_RELEASES])
    ledger = (args.ledger or conclave_home() / "owners").expanduser().resolve()
    policy = OwnerPolicy(args.name, args.epsilon, str(ledger), args.delta, args.neighbouring, args.order,
                         args.reserved_delta, tuple(args.pipelines), tuple(args.mechanisms), args.max_run_epsilon,
                         tuple(str(p.expanduser().resolve()) for p in args.data))
    written = write_policy(policy)
    terms = policy.terms()
    print(f"owner {policy.owner}: policy written to {written}\n"
          f"  lifetime budget ε {policy.epsilon:g} at δ {policy.delta:g} ({policy.neighbouring}), its ledger in "
          f"{policy.ledger}\n  admits pipelines: {_listed(terms['pipelines'])}; mechanisms: "
          f"{_listed(terms['mechanisms'])}; per run at most ε {policy.max_run_epsilon or 'any'}\n"
          f"  data guarded on this node: {', '.join(policy.data) or 'none named'}")
    return 0


def _change(args: argparse.Namespace) -> int:
    from conclave.privacy.accounting.owner_policy import OwnerPolicy, OwnerRefused, change_budget

    policy = OwnerPolicy.load(args.name)
    if policy is not None and (args.epsilon > policy.epsilon) != (args.action == "raise"):
        other = "lower" if args.action == "raise" else "raise"
        raise OwnerRefused(f"owner {args.name}: ε {args.epsilon:g} does not {args.action} its lifetime ε "
                           f"{policy.epsilon:g}; use `conclave owner {other}`")
    changed, entry = change_budget(args.name, args.epsilon)
    verb = "raised" if args.action == "raise" else "lowered"
    ledger = changed.budget().ledger_path(args.name)
    where = (f"recorded as entry {entry.entry} of its ledger {ledger}, {entry.as_dict()['when']}" if entry is not None
             else "no ledger yet: nothing was spent under the old one")
    print(f"owner {args.name}: lifetime budget {verb} from ε {policy.epsilon:g} to ε {changed.epsilon:g} ({where})")
    if args.action == "raise":
        print("  the lifetime guarantee is now ε {:g}, covering every release so far; a raise decided after seeing "
              "results is a new commitment (docs/owners.md)".format(changed.epsilon))
    return 0


def _show(args: argparse.Namespace) -> int:
    from conclave.privacy.accounting.ledger import read_ledger
    from conclave.privacy.accounting.owner_policy import OwnerPolicy, OwnerRefused

    policies = [OwnerPolicy.load(name) for name in args.names] if args.names else OwnerPolicy.on_node()
    missing = [name for name, policy in zip(args.names, policies) if policy is None]
    if missing:
        raise OwnerRefused(f"owner {missing[0]} has no policy on this node ({OwnerPolicy.file(missing[0])})")
    shown = []
    for policy in policies:
        path = policy.budget().ledger_path(policy.owner)
        snapshot = read_ledger(path) if path.exists() else None
        shown.append({"owner": policy.owner, "policy": policy.terms(), "data": list(policy.data),
                      "ledger": str(path), "charges": None if snapshot is None else snapshot.charges,
                      "budget_changes": [] if snapshot is None else [c.as_dict() for c in snapshot.changes]})
    if args.json:
        print(json.dumps(shown, indent=2))
    elif not shown:
        print("no owner policies on this node")
    for entry in shown if not args.json else ():
        terms = entry["policy"]
        charged = "no ledger yet" if entry["charges"] is None else f"{entry['charges']} charges"
        print(f"owner {entry['owner']}: ε {terms['epsilon']:g} at δ {terms['delta']:g} lifetime, {charged} "
              f"({entry['ledger']}); pipelines {_listed(terms['pipelines'])}; mechanisms "
              f"{_listed(terms['mechanisms'])}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The gateway until Ctrl-C or SIGTERM: the owner's policy is required before Ray starts; one
    line once serving, one when stopped."""
    import logging
    import os

    from conclave.cluster.gateway.declaration import load_declaration
    from conclave.cluster.gateway.server import owner_policy, start_gateway
    from conclave.cluster.ray_runtime import start_ray, stop_ray
    from conclave.cluster.tls import HandshakeLog

    declaration = load_declaration(args.declaration)
    owner_policy(declaration.name)  # refused before anything starts
    if declaration.ray.address == "local":
        os.environ.pop("RAY_ADDRESS", None)  # an owner's local Ray never joins a cluster it did not name
    start_ray(None if declaration.ray.address == "local" else declaration.ray.address, declaration.ray.num_cpus)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after Ray's start, which sets its own
        signal.signal(signum, lambda *_: stop.set())
    handshakes = HandshakeLog(logging.getLogger("conclave.cluster.gateway"))  # a port scan is one line, not thousands
    handshakes.start()
    server = None
    try:
        server = start_gateway(declaration)
        print(f"owner {declaration.name}: gateway serving on {server.address} (mutual TLS, Ray "
              f"{declaration.ray.address}); Ctrl-C or SIGTERM stops it", flush=True)
        stop.wait()
    finally:
        if server is not None:
            server.stop()
        stop_ray()
        handshakes.stop()
    print(f"owner {declaration.name}: gateway stopped", flush=True)
    return 0


def _check_names(kind: str, given: list[str], known: list[str]) -> None:
    unknown = [name for name in given if name not in known]
    if unknown:
        raise InvalidValue(f"unknown {kind}(s) {unknown}; known: {', '.join(known)}")


def _listed(value) -> str:
    return value if isinstance(value, str) else ", ".join(value)
