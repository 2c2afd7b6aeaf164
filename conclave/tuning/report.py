"""What a sweep leaves behind: a table of trials, the winner with the ε that includes the
tuning, and a plot of accuracy against ε per configuration.

Files in ``results/<sweep>/``: ``trials.csv`` (one row per trial), ``sweep.json`` (the
trials with their accuracy-vs-ε history, the best trial, the sweep's privacy cost and the
theorem behind it) and ``accuracy_vs_epsilon.png``. A random-repetition sweep writes its
winner alone, named ``WINNER`` instead of its Ray trial id (which carries its index).
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conclave.cluster.api import RunDirectory
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.tuning_cost import SweepCost
from conclave.tuning import spaces

log = logging.getLogger(__name__)

# The published name of a random-repetition sweep's winner. A constant carries nothing about
# the trials by construction (a token drawn from OS entropy would too, but names nothing more:
# one winner per sweep, and the sweep has its name).
WINNER = "winner"


@dataclass
class TrialRow:
    trial_id: str
    status: str  # "ok" or "error"
    values: dict[str, Any]  # the swept keys' values
    accuracy: float  # the last reported test accuracy
    epsilon: float  # this trial's own ε (last report)
    reports: int
    history: list[tuple[float, float]] = field(default_factory=list)  # (ε, accuracy) per report
    extra: dict[str, Any] = field(default_factory=dict)  # other numbers of the last report
    error: str = ""


_CHARGE_KEYS = ("rdp", "extra_delta", "unbounded")
_SKIP = {"accuracy", "epsilon", *_CHARGE_KEYS, "timestamp", "checkpoint_dir_name", "done", "training_iteration",
         "trial_id", "date", "time_this_iter_s", "time_total_s", "pid", "hostname", "node_ip", "config",
         "time_since_restore", "iterations_since_restore", "experiment_tag"}


def collect(grid, space: dict[str, Any]) -> tuple[list[TrialRow], list[dict[str, Any] | None]]:
    """Rows of a Tune ``ResultGrid`` and each trial's last report (None if it never reported)."""
    rows: list[TrialRow] = []
    finals: list[dict[str, Any] | None] = []
    for result in grid:
        metrics = result.metrics or {}
        frame = result.metrics_dataframe
        history = []
        if frame is not None and "accuracy" in frame and "epsilon" in frame:
            history = [(float(e), float(a)) for e, a in zip(frame["epsilon"], frame["accuracy"])]
        reported = "accuracy" in metrics
        rows.append(TrialRow(
            trial_id=str(metrics.get("trial_id") or Path(str(result.path)).name),
            status="error" if result.error else "ok",
            values=spaces.overrides(space, result.config),
            accuracy=float(metrics["accuracy"]) if reported else math.nan,
            epsilon=float(metrics["epsilon"]) if reported else math.nan,
            reports=len(history),
            history=history,
            extra={k: v for k, v in metrics.items() if k not in _SKIP and isinstance(v, (int, float, str))},
            error=str(result.error).splitlines()[0][:300] if result.error else "",
        ))
        finals.append(metrics if reported else None)
    return rows, finals


def best_row(rows: list[TrialRow]) -> TrialRow | None:
    finite = [r for r in rows if math.isfinite(r.accuracy)]
    return max(finite, key=lambda r: r.accuracy) if finite else None


def published_winner(rows: list[TrialRow]) -> list[TrialRow]:
    """What a random-repetition sweep may publish of its trials: the best one alone (none if
    every trial failed), renamed ``WINNER`` — its Ray trial id ends in its index."""
    best = best_row(rows)
    return [] if best is None else [dataclasses.replace(best, trial_id=WINNER)]


def _fmt(value: Any, digits: int = 6) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, (list, tuple)):
        return "/".join(_fmt(v, digits) for v in value)
    return str(value)


def _label(values: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(v, 3)}" for k, v in values.items())


@dataclass(frozen=True)
class SweepResult:
    """A finished sweep, as ``run_sweep`` returns it; ``path/sweep.json`` holds the same.

    ``hidden``: random repetition — ``rows`` is the published winner only and the number of
    trials stays secret (``trials`` and ``failed`` are None)."""

    name: str
    kind: str
    path: Path
    rows: list[TrialRow]
    best: TrialRow | None
    cost: SweepCost
    details: dict[str, Any]
    hidden: bool = False

    @property
    def trials(self) -> int | None:
        return None if self.hidden else len(self.rows)

    @property
    def failed(self) -> int | None:
        return None if self.hidden else sum(r.status == "error" for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        """What ``sweep.json`` holds, less the rows."""
        cost = self.cost
        summary: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "trials": self.trials,
            "failed": self.failed,
            "tuning_cost": {"method": cost.method, "free": cost.free, "epsilon": cost.epsilon, "delta": cost.delta,
                            "order": cost.order, "statement": cost.statement},
            **self.details,
        }
        if self.best is not None:
            best = self.best
            summary["best"] = {"trial_id": best.trial_id, "values": best.values, "accuracy": best.accuracy,
                               "epsilon_trial": best.epsilon, "epsilon_with_tuning": cost.epsilon,
                               "delta": cost.delta}
        return summary


def write(results: RunDirectory, name: str, kind: str, rows: list[TrialRow], cost: SweepCost,
          details: dict[str, Any], hidden: bool = False) -> SweepResult:
    """Write trials.csv, sweep.json and the plot; return the sweep's result.

    ``hidden``: the rows are the published winner only (``published_winner``) and the number
    of trials stays secret (random repetition), so no count is written."""
    result = SweepResult(name, kind, results.path, rows, best_row(rows), cost, details, hidden)
    results.write_json("sweep", {**result.as_dict(), "rows": [_row_json(r) for r in rows]})
    _write_csv(results.path / "trials.csv", rows)
    _plot(results.path / "accuracy_vs_epsilon.png", name, rows, result.best, cost, details.get("release"))
    return result


def _row_json(row: TrialRow) -> dict[str, Any]:
    return {"trial_id": row.trial_id, "status": row.status, "values": row.values, "accuracy": row.accuracy,
            "epsilon": row.epsilon, "reports": row.reports, "history": row.history, "extra": row.extra,
            "error": row.error}


def _write_csv(path: Path, rows: list[TrialRow]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r.values))
    extras = list(dict.fromkeys(k for r in rows for k in r.extra))
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["trial_id", "status", *keys, "accuracy", "epsilon", "reports", *extras, "error"])
        for r in rows:
            writer.writerow([r.trial_id, r.status, *(_fmt(r.values.get(k, "")) for k in keys),
                             f"{r.accuracy:.4f}", f"{r.epsilon:.4f}", r.reports,
                             *(r.extra.get(k, "") for k in extras), r.error])
    log.info("wrote %s", path)


def _plot(path: Path, name: str, rows: list[TrialRow], best: TrialRow | None, cost: SweepCost,
          release: dict[str, Any] | None) -> None:
    """Accuracy against ε, one curve per configuration; beside it accuracy against the labels
    bought when the trials bought labels (active learning)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_labels = any("n_labeled" in r.extra for r in rows)
    fig, axes = plt.subplots(1, 2 if by_labels else 1, figsize=(11 if by_labels else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for row in rows:
        points = [(e, a) for e, a in row.history if math.isfinite(e) and math.isfinite(a)]
        if not points:
            continue
        xs, ys = zip(*points)
        is_best = best is not None and row.trial_id == best.trial_id
        line, = ax.plot(xs, ys, marker="o", markersize=4, linewidth=2.2 if is_best else 1.0,
                        label=("★ " if is_best else "") + _label(row.values))
        if by_labels and "n_labeled" in row.extra:
            axes[0][1].plot([row.extra["n_labeled"]], [row.accuracy], marker="*" if is_best else "o",
                            markersize=10 if is_best else 6, color=line.get_color())
    if release is not None:  # the one DP release a free sweep post-processes
        ax.plot([release["epsilon"]], [release["accuracy"]], marker="x", color="black", markersize=8,
                linestyle="none", label="the DP checkpoint alone")
        if by_labels:
            axes[0][1].axhline(release["accuracy"], color="black", linestyle=":", linewidth=1)
    if math.isfinite(cost.epsilon):
        ax.axvline(cost.epsilon, color="black", linestyle="--", linewidth=1,
                   label=f"sweep ε incl. tuning = {cost.epsilon:.3g}" + (" (free)" if cost.free else ""))
    ax.set_xlabel(f"ε (δ = {cost.delta:g}), each trial alone")
    ax.set_ylabel("test accuracy")
    ax.set_title(name)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to label when every trial failed
        ax.legend(fontsize=6, loc="lower right")
    if by_labels:
        axes[0][1].set_xlabel("labels bought (N_labeled)")
        axes[0][1].set_ylabel("test accuracy")
        axes[0][1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def charges_of(finals: list[dict[str, Any] | None], charge_from_fields) -> list[PrivacyCharge] | None:
    """Every trial's reported charge, or None when a trial never reported one."""
    charges = []
    for final in finals:
        if final is None or any(k not in final for k in _CHARGE_KEYS):
            return None
        charges.append(charge_from_fields(final))
    return charges
