"""Trials: one Ray Tune function trainable that runs a sweep kind's piece of a pipeline.

``KINDS``: ``teacher_ensemble``, ``near_private``, ``diverse_public`` (free: one checkpoint
trained before the sweep) and ``sparsity``. Pipelines run in a task outside the trial's placement
group, where their actors would not fit. Every report carries the trial's whole privacy charge,
charged before training, so a trial stopped early still counts in full. Every trial that reads
private data runs its pipeline, so the owners admit it and charge their ledgers.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray

from conclave.cluster.api import Pipeline, PublicPretraining, RunContext, RunDirectory, RunOutcome, load_pipeline
from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.pld import GaussianSteps
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS
from conclave.tuning import spaces

log = logging.getLogger(__name__)

TRIAL_MEMORY_BYTES = 64 * 2**20  # what a trial that only waits on its pipeline reserves


@dataclass(frozen=True)
class Kind:
    pipeline: str
    per_epoch: bool  # reports during training, so ASHA can stop it
    in_process: bool  # trains in the trial's own process (else the pipeline's actors do)
    free: bool  # trials only post-process one DP release made before the sweep
    fixed_keys: tuple[str, ...] = ()  # prepared once before the sweep: may not be swept
    privacy_keys: tuple[str, ...] | None = None  # decide a trial's charge; None: no random repetition


KINDS: dict[str, Kind] = {
    "teacher_ensemble": Kind("teacher_student", per_epoch=False, in_process=False, free=False),
    "near_private": Kind("active_learning", per_epoch=False, in_process=False, free=False),
    "diverse_public": Kind(
        "active_learning", per_epoch=False, in_process=True, free=True,
        fixed_keys=("data.", "dpsgd.", "model", "privacy.", "seed"),
    ),
    "sparsity": Kind(
        "sparse_finetune", per_epoch=True, in_process=False, free=False,
        fixed_keys=("model.", "public.", "pretrain.", "seed"),
        privacy_keys=("private.", "privacy.", "finetune.epochs", "finetune.batch_size",
                      "finetune.noise_multiplier", "finetune.target_epsilon"),
    ),
}


def trial_config(kind: str, base: dict, values: dict[str, Any]) -> tuple[dict, Pipeline]:
    """(raw run config, its pipeline) of the trial with these dotted-key values."""
    values = dict(values)
    if kind == "teacher_ensemble" and "mechanism.params.threshold_fraction" in values:
        # T scales with the ensemble: a fraction of the number of teachers, so T and the count can be swept
        # together; the count is the config's own (the owners' sum, teachers.count or its default).
        fraction = float(values.pop("mechanism.params.threshold_fraction"))
        teachers = load_pipeline(spaces.apply(base, values)).config.num_teachers
        values["mechanism.params.threshold"] = fraction * teachers
    if kind == "diverse_public" and "selection.n_cluster" in values:
        # N_cluster is a tuning knob, not a config key: N_labeled = N_cluster × N_each.
        n_each = values.get("selection.n_each", base.get("selection", {}).get("n_each", 10))
        values["selection.sizes"] = [int(values.pop("selection.n_cluster")) * int(n_each)]
    raw = spaces.apply(base, values)
    return raw, load_pipeline(raw)


# --- reporting ---------------------------------------------------------------------------


def charge_fields(charge: PrivacyCharge) -> dict[str, Any]:
    """A charge as plain report fields; its Gaussian plan travels too (the sweep's PLD needs it)."""
    plan = None if charge.pld is None else [[s.noise_multiplier, s.count, s.sample_rate] for s in charge.pld]
    return {"rdp": [float(v) for v in charge.rdp], "extra_delta": float(charge.extra_delta),
            "unbounded": bool(charge.unbounded), "gaussian_plan": plan}


def charge_from_fields(metrics: dict[str, Any]) -> PrivacyCharge:
    """The charge a trial reported (inverse of ``charge_fields``)."""
    rdp = np.asarray(metrics["rdp"], dtype=float)
    if rdp.shape != DEFAULT_ORDERS.shape:
        raise InvalidValue("a trial reported its charge on a different grid of orders")
    plan = metrics.get("gaussian_plan")
    return PrivacyCharge(DEFAULT_ORDERS, rdp, extra_delta=float(metrics["extra_delta"]),
                         unbounded=bool(metrics["unbounded"]), reason="a trial had no finite guarantee"
                         if metrics["unbounded"] else "",
                         pld=None if plan is None else tuple(GaussianSteps(float(z), int(n), float(q))
                                                             for z, n, q in plan))


def _report(accuracy: float, epsilon: float, charge: PrivacyCharge, **extra: Any) -> None:
    from ray import tune

    tune.report({"accuracy": float(accuracy), "epsilon": float(epsilon), **charge_fields(charge), **extra})


# --- whole pipelines, outside the trial's placement group ----------------------------------


@ray.remote(num_cpus=0)
def _run_pipeline(pipeline: Pipeline, run: Callable[[RunContext], RunOutcome],
                  directory: str) -> tuple[RunOutcome, dict]:
    """``run`` (``pipeline.run`` or one of its trial hooks) into ``directory``/run; (its outcome,
    the charge fields of the pipeline's planned work).

    A trial's charge is its planned worst case, fixed before it ran: the realised spend
    depends on what the trial released, and adding those up would not be a guarantee."""
    outcome = run(RunContext("trial", RunDirectory(directory, "run"), None))
    return outcome, charge_fields(pipeline.plan())


def _pipeline_outside_trial(pipeline: Pipeline, trial_dir: Path,
                            run: Callable[[RunContext], RunOutcome] | None = None) -> tuple[RunOutcome, PrivacyCharge]:
    outcome, fields = ray.get(_run_pipeline.options(scheduling_strategy="DEFAULT").remote(
        pipeline, run or pipeline.run, str(trial_dir)))
    return outcome, charge_from_fields(fields)


def _teacher_ensemble(pipeline: Pipeline, prepared: Any, trial_dir: Path) -> None:
    outcome, charge = _pipeline_outside_trial(pipeline, trial_dir)
    student = outcome.result
    for point in student.curve[:-1]:
        _report(point["accuracy"], float(point["budget"].get("epsilon_spent", math.nan)), charge,
                answered=point["answered"])
    _report(student.accuracy, outcome.privacy.epsilon, charge, answered=student.answered, asked=student.asked,
            label_accuracy=student.label_accuracy)


def _near_private(pipeline: Pipeline, prepared: Any, trial_dir: Path) -> None:
    selection = pipeline.config.selection
    if tuple(selection.strategies) != ("near_private",) or len(selection.sizes) != 1:
        raise InvalidValue("near_private sweeps need selection.strategies [near_private] and one N_labeled "
                         "(selection.sizes: [N])")
    outcome, charge = _pipeline_outside_trial(pipeline, trial_dir)
    for row in outcome.result.checkpoints:  # the DP-SGD model alone, epoch by epoch
        _report(row["test_accuracy"], row["epsilon"], charge, stage="dpsgd")
    final = outcome.result.rows[-1]
    _report(final["accuracy"], outcome.privacy.per_model["near_private"].epsilon, charge, stage="near_private",
            n_labeled=final["n_labeled"], start_epoch=final["start_epoch"])


def _sparsity(pipeline: Pipeline, prepared: PublicPretraining, trial_dir: Path) -> None:
    """One variant of the sparse_finetune pipeline on the sweep's public model, reported every epoch."""
    variants = pipeline.config.finetune.variants
    if len(variants) != 1:
        raise InvalidValue("a sparsity trial fine-tunes one variant: sweep finetune.variants over "
                         "one-element lists, e.g. {choice: [[classifier], [all]]}")
    # every trial draws its own fresh noise (independent trials, as Papernot & Steinke's Thm 2 needs)
    outcome, charge = _pipeline_outside_trial(pipeline, trial_dir, lambda context: pipeline.trial(context, prepared))
    result = outcome.result.variants[variants[0]]
    for epoch, (accuracy, epsilon) in enumerate(zip(result["accuracies"], result["epsilons"])):
        _report(accuracy, epsilon, charge, epoch=epoch + 1, trained_fraction=result["trained_fraction"],
                noise_multiplier=result["noise_multiplier"])


# --- trials in the trial's own process ----------------------------------------------------


def _diverse_public(pipeline: Pipeline, prepared: dict, trial_dir: Path) -> None:
    """DiversePublic on the sweep's fixed DP checkpoint, through the pipeline's own selection
    and fine-tuning phase on the public side only (``ActiveLearning.improve_public``)."""
    config = pipeline.config
    rows = pipeline.improve_public(prepared["checkpoint"], trial_dir)
    nothing = PrivacyCharge(DEFAULT_ORDERS, np.zeros_like(DEFAULT_ORDERS))  # post-processing
    row = rows[-1]
    _report(row["accuracy"], prepared["epsilon"], nothing, n_labeled=row["n_labeled"],
            n_cluster=math.ceil(row["n_labeled"] / config.selection.n_each),
            checkpoint_accuracy=prepared["accuracy"])


TRIALS: dict[str, Callable[[Pipeline, Any, Path], None]] = {
    "teacher_ensemble": _teacher_ensemble,
    "near_private": _near_private,
    "diverse_public": _diverse_public,
    "sparsity": _sparsity,
}


def run_trial(params: dict[str, Any], *, kind: str, base: dict, space: dict, prepared: Any = None) -> None:
    """The function trainable: the base config with this trial's values, run by its kind."""
    from ray import tune

    _, pipeline = trial_config(kind, base, spaces.overrides(space, params))
    trial_dir = Path(tune.get_context().get_trial_dir())
    trial_dir.mkdir(parents=True, exist_ok=True)
    try:
        TRIALS[kind](pipeline, prepared, trial_dir)
    except Exception:
        _report_planned_before_failing(pipeline, trial_dir)
        raise


def _report_planned_before_failing(pipeline: Pipeline, trial_dir: Path) -> None:
    """A failed trial may have released part of its work: report its planned worst case — or
    a zero charge when no ledger recorded anything, since nothing is released before its
    charge — so the sweep can account for it (without a report the sweep's ε is unbounded)."""
    from conclave.privacy.accounting.guarantee import worst_case_guarantee
    from conclave.privacy.accounting.ledger import read_ledger

    ledger = trial_dir / "run" / "ledger.sqlite"
    # read, not opened to charge: the failed run may still hold its ledger's writer lock
    charged = ledger.is_file() and read_ledger(ledger).charges > 0
    if not charged:
        _report(math.nan, 0.0, PrivacyCharge(DEFAULT_ORDERS, np.zeros_like(DEFAULT_ORDERS)), failed=True)
        return
    planned = pipeline.plan()
    _report(math.nan, worst_case_guarantee(planned, pipeline.config.privacy.delta).epsilon, planned, failed=True)


# --- what a sweep prepares once, before its trials ------------------------------------------


def prepare(kind: str, pipeline: Pipeline, results: RunDirectory) -> dict[str, Any] | PublicPretraining | None:
    """Build what every trial of ``kind`` shares; returns None when trials share nothing."""
    if kind == "diverse_public":
        return _prepare_checkpoint(pipeline, results)
    if kind == "sparsity":
        return pipeline.pretrain(results)  # public data only: free
    return None


def _prepare_checkpoint(pipeline: Pipeline, results: RunDirectory) -> dict[str, Any]:
    """One DP-SGD checkpoint for a free sweep: the active-learning pipeline's final checkpoint,
    trained once through the pipeline (its ledger, the owners' admission and ledgers); every
    trial post-processes it."""
    from conclave.privacy.accounting.ledger import PrivacyLedger

    config = pipeline.config
    once = pipeline.with_config(dataclasses.replace(
        config, selection=dataclasses.replace(config.selection, strategies=("diverse_public",))))
    run_dir = RunDirectory(results.path, "checkpoint")
    outcome = once.run(RunContext("checkpoint", run_dir))
    with PrivacyLedger.open_existing(run_dir.path / "ledger.sqlite") as ledger:
        charge = ledger.spent()
    final, checkpoint = once.released_checkpoint(run_dir)
    return {"checkpoint": checkpoint, "charge": charge, "epsilon": outcome.privacy.epsilon,
            "accuracy": outcome.result.checkpoints[-1]["test_accuracy"], "path": str(final)}
