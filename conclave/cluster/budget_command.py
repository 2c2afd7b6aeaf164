"""``conclave budget [LEDGER ...]``: where privacy budgets went, per owner and per run.

Reads ledgers without writing to them (``read_ledger``: no lock is taken, so a running job is
not disturbed; every file's checksum chain is verified) and prints, for each, its lifetime or
run budget, the realised spend, what the filter has left — marking a budget **exhausted** when
what is left pays for none of the charges it ever paid for — and with ``--history`` every entry:
when, which run (by its run name), which mechanism, what it would cost alone, and the owner's
raises and lowerings of its budget. ``--json`` prints the same as one JSON document. Without
arguments it reads this machine's owner ledgers (``$CONCLAVE_HOME/owners``, by default
``~/.conclave/owners``: run it on each owner's node) and the run ledgers under ``./results``.
Exit status 2 when a ledger is damaged or unreadable.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conclave.cluster.config import ConfigError
from conclave.errors import fail

RUN_LEDGERS = ("ledger.sqlite", "serve-ledger.sqlite")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("ledgers", nargs="*", type=Path,
                        help="ledger files or folders holding them (default: this machine's owner ledgers and "
                             "the run ledgers under ./results)")
    parser.add_argument("--history", action="store_true", help="list every charge of each ledger")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


@dataclass(frozen=True)
class LedgerView:
    """One ledger as ``conclave budget`` shows it."""

    kind: str  # "owner" | "run"
    name: str
    path: Path
    snapshot: Any  # privacy.accounting.ledger.LedgerSnapshot
    history: tuple  # privacy.accounting.ledger.ChargeRecord, in order

    @property
    def charges(self) -> list:
        """The history's charges, without the budget's changes."""
        from conclave.privacy.accounting.ledger import BUDGET_CHANGE

        return [r for r in self.history if r.label != BUDGET_CHANGE]

    @property
    def runs(self) -> list[str]:
        return sorted({str(r.details.get("run", "")) for r in self.charges} - {""})

    @property
    def exhausted(self) -> bool:
        """Whether what the budget has left pays for none of the charges it ever paid for (or
        for nothing at all): a run like any before it would be refused."""
        budget = self.snapshot.budget
        if budget is None:
            return False
        from conclave.privacy.accounting.filter import order_index

        left = budget.rdp_budget - _at_order(self.snapshot)
        costs = [float(r.charge.rdp[order_index(budget.order, self.snapshot.orders)]) for r in self.charges]
        paid = [c for c in costs if c > 0]
        return left <= 0 or (bool(paid) and left < min(paid))

    def as_dict(self) -> dict[str, Any]:
        snapshot, budget = self.snapshot, self.snapshot.budget
        spent = _epsilon(snapshot.spent, snapshot.delta)
        left = None if budget is None else max(0.0, budget.rdp_budget - _at_order(snapshot))
        guarantee = snapshot.guarantee
        return {
            "kind": self.kind, "name": self.name, "path": str(self.path), "ledger_id": snapshot.ledger_id,
            "budget": None if budget is None else {"epsilon": budget.epsilon, "delta": budget.delta,
                                                   "order": budget.order, "rdp_budget": budget.rdp_budget,
                                                   "guarantee_epsilon": guarantee.epsilon},
            "exhausted": self.exhausted,
            "budget_changes": [c.as_dict() for c in snapshot.changes],
            "neighbouring": snapshot.neighbouring,
            "spent": {"epsilon": spent, "delta": snapshot.delta, "charges": snapshot.charges,
                      "rdp_at_budget_order": None if budget is None else _at_order(snapshot), "rdp_left": left,
                      "note": "realised spend, not the guarantee: the guarantee is the budget"},
            "runs": self.runs,
            "history": [_entry(r, snapshot.delta) for r in self.history],
        }


def _entry(record, delta: float) -> dict[str, Any]:
    """One entry of a ledger's history: a charge, or a change of the budget."""
    from conclave.privacy.accounting.ledger import BUDGET_CHANGE

    entry = {"charge": record.id, "when": _when(record.created), "run": record.details.get("run"),
             "what": record.label, "epsilon_alone": _epsilon(record.charge, delta)}
    if record.label == BUDGET_CHANGE:
        before, after = record.details["previous"], record.details["epsilon"]
        entry.update(run=None, what=f"budget {'raised' if after > before else 'lowered'}: ε {before:g} → {after:g}")
    return entry


def main(args: argparse.Namespace) -> int:
    from conclave.privacy.accounting.ledger import LedgerDamaged
    from conclave.privacy.accounting.ledger_records import conclave_home

    targets = args.ledgers or [conclave_home() / "owners", Path("results")]
    try:
        files = _ledger_files(targets, explicit=bool(args.ledgers))
    except OSError as err:
        return fail(ConfigError(str(err)))
    views, problems = [], []
    for entry in files:
        try:
            views.append(_view(entry))
        except (OSError, ValueError) as err:  # LedgerDamaged is a ValueError: one line naming the file
            problems.append(str(err).splitlines()[0])
    if args.json:
        print(json.dumps([v.as_dict() for v in views], indent=2, default=str))
    elif views:
        _print_table(views)
        for view in views if args.history else ():
            _print_history(view)
    elif not problems:
        print("no ledgers found in " + ", ".join(str(t) for t in targets))
    for problem in problems:  # the others are listed; these are refused, as a run would refuse them
        print(f"conclave: {problem}", file=sys.stderr)
    return LedgerDamaged.exit_code if problems else 0


def _ledger_files(targets: list[Path], explicit: bool) -> list[tuple[str, Path]]:
    """(kind, file) of every ledger under ``targets``: a folder of owner ledgers (``*.sqlite``),
    a results folder (``*/ledger.sqlite``), or files. A target given explicitly must exist."""
    found: list[tuple[str, Path]] = []
    for target in targets:
        if target.is_file():
            found.append(("run" if target.name in RUN_LEDGERS else "owner", target))
        elif target.is_dir():
            runs = sorted(p for name in RUN_LEDGERS for p in [*target.glob(name), *target.glob(f"*/{name}")])
            owners = sorted(p for p in target.glob("*.sqlite") if p.name not in RUN_LEDGERS)
            found += [("owner", p) for p in owners] + [("run", p) for p in runs]
        elif explicit:
            raise FileNotFoundError(f"{target}: no such ledger file or folder")
    return found


def _view(entry: tuple[str, Path]) -> LedgerView:
    from conclave.privacy.accounting.ledger import read_history, read_ledger

    kind, path = entry
    name = path.stem if kind == "owner" else path.parent.name
    return LedgerView(kind, name, path, read_ledger(path), tuple(read_history(path)))


def _print_table(views: list[LedgerView]) -> None:
    rows = [("", "name", "budget (the guarantee)", "spent ε (realised, RDP)", "RDP left at the budget's order",
             "charges", "runs", "ledger")]
    for view in views:
        d = view.as_dict()
        budget = d["budget"]
        changed = "" if not d["budget_changes"] else f", {d['budget_changes'][-1]['change']} " \
            f"{d['budget_changes'][-1]['when'][:10]}"
        rows.append((
            view.kind, view.name + (" (EXHAUSTED)" if d["exhausted"] else ""),
            "none (record only)" if budget is None else
            f"ε {budget['epsilon']:g} at δ {budget['delta']:g}, order {budget['order']:g}{changed}",
            _number(d["spent"]["epsilon"]),
            "-" if d["spent"]["rdp_left"] is None else f"{d['spent']['rdp_left']:.4g} of {budget['rdp_budget']:.4g}",
            str(d["spent"]["charges"]), ", ".join(d["runs"]) or "-", str(view.path)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(LEGEND)


LEGEND = ("spent ε: what the charges so far compose to in RDP, at its best order — the figure a run reports as "
          "spent, not the guarantee (that is the budget). RDP left: at the budget's fixed order, where the filter "
          "decides; a refusal quotes RDP at that order, not ε.")


def _print_history(view: LedgerView) -> None:
    print(f"\n{view.kind} {view.name}: {len(view.charges)} charges ({view.path})")
    for entry in view.as_dict()["history"]:
        print(f"  #{entry['charge']:<4} {entry['when']}  run {entry['run'] or '-':<20} {entry['what']:<28} "
              f"ε alone {_number(entry['epsilon_alone'])}")


def _at_order(snapshot) -> float:
    from conclave.privacy.accounting.filter import order_index

    return float(snapshot.spent.rdp[order_index(snapshot.budget.order, snapshot.orders)])


def _epsilon(charge, delta: float) -> float:
    """Realised spend as a run reports it (``BudgetReport.epsilon_spent``): the RDP composition
    converted at its best order — not a PLD figure, which holds only for work fixed in advance."""
    from conclave.privacy.accounting.rdp import epsilon_from_rdp

    if charge.is_free:
        return 0.0
    if charge.unbounded or charge.extra_delta >= delta:
        return math.inf
    return float(epsilon_from_rdp(charge.orders, charge.rdp, delta - charge.extra_delta, conversion="tight")[0])


def _number(value: float) -> str:
    return "inf" if not math.isfinite(value) else f"{value:.4g}"


def _when(created: float) -> str:
    return datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
