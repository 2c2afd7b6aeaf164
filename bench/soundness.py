"""The ``sound`` field at the top of every results/bench/*.json.

``sound`` is true exactly when no reason against it is known: every ε the file states is a
theorem for every pair of neighbouring datasets (finite, its noise from OS entropy), and no
figure in the file is computed from data in the private role without a mechanism.
``unsound_reasons`` says why not, one sentence each.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def soundness(reasons: Iterable[str | None]) -> dict[str, Any]:
    """``{"sound": ..., "unsound_reasons": [...]}``; ``None`` stands for no reason (e.g. a
    ``NoisePolicy``'s ``unsound_reason`` under OS entropy) and repeats count once."""
    kept = list(dict.fromkeys(reason for reason in reasons if reason))
    return {"sound": not kept, "unsound_reasons": kept}


def run_reasons(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The reasons of every run whose ``sound`` is false, each prefixed with the run's name."""
    return [f"{name}: {reason}" for name, run in runs.items() if not run["sound"]
            # a run merged from a file written before runs listed their reasons
            for reason in run.get("unsound_reasons") or ["its report says sound: false"]]


def timed_private_work(data: str) -> str:
    """The reason a file that times work on data in the private role is not sound: how long that
    work took is a figure computed from the data, without a mechanism (stand-in data or not; a run
    on an owner's records publishes none). Such timings go to a file of their own, or make the
    file's ``sound`` false."""
    return f"times work on the data in the private role ({data}) without a mechanism"


def timed_on(data: str) -> dict[str, str]:
    """``{"timings": ...}``: the statement a benchmark file carries when it publishes seconds or
    rates. Runs on an owner's records publish none (how long private work takes grows with the
    records, docs/privacy.md); a benchmark may time the same code on public stand-in data, and
    says which."""
    return {"timings": f"measured on public stand-in data ({data}); a run on an owner's records publishes "
                       "no timing of its private work"}
