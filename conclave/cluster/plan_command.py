"""``conclave plan CONFIG``: what a run config's budget buys, before any data is read.

From the config alone (no data file, no Ray, no torch): the declared counts, the planned work,
the guarantee a run would state, and a table of what the budget admits at nearby noise levels,
with warnings for settings that do not fit. ``--propose`` sizes a config instead
(``cluster.proposal``); ``--json`` prints the ``Plan``. A bad config is one line, exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import Pipeline, load_pipeline
from conclave.cluster.proposal import CHOICES, propose, render
from conclave.cluster.teaching.config import MechanismConfig
from conclave.cluster.results import _jsonable
from conclave.errors import ConclaveError, fail
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, order_index
from conclave.privacy.accounting.composition import PublishedRun
from conclave.privacy.accounting.guarantee import Guarantee, worst_case_guarantee
from conclave.privacy.mechanisms.base import parameters_of

NOISE_FACTORS = (0.75, 1.5, 2.0)  # the neighbouring settings: the configured noise times these
MAX_ANSWERS = 10**8  # the table's search stops here ("at least")
MAX_EPOCHS = 10**5
RECORDS_PER_TEACHER = 20  # fewer, and each teacher learns from too little to vote well


class PlanError(ConclaveError):
    """A config ``plan`` cannot price from the config alone; the message is the one line."""

    exit_code = 2


@dataclass(frozen=True)
class OwnerCounts:
    name: str
    teachers: int | None  # teacher_student only
    records: int | None  # declared (a public upper bound)
    lifetime: float | None = None  # the owner's lifetime ε, if it declares one
    runs_per_lifetime: int | None = None  # runs like this one a fresh lifetime ledger pays for


def owner_counts(owner: Any, teachers: int | None, config: Any, planned: PrivacyCharge) -> OwnerCounts:
    """What ``owner`` declares, and how many runs like this one its lifetime budget pays for
    from a fresh ledger (whose order a first run fixes): each run's bound at that order is its
    planned worst case, lowered to its own budget (``privacy.accounting.composition``). An
    existing ledger's order and spend are on the owner's node: ``conclave budget`` there."""
    if owner.budget is None:
        return OwnerCounts(owner.name, teachers, owner.records)
    lifetime = owner.budget.filter(planned)
    bound = PublishedRun(config.name, planned, config.privacy.budget_filter(planned)).bound()
    per_run = float(bound.rdp[order_index(lifetime.order, bound.orders)])
    runs = MAX_ANSWERS if per_run <= 0 else int(lifetime.rdp_budget // per_run)
    return OwnerCounts(owner.name, teachers, owner.records, owner.budget.epsilon, runs)


@dataclass(frozen=True)
class Counts:
    """What the config declares: its owners, teachers and private records (None: not declared,
    e.g. a benchmark's whole training split)."""

    owners: tuple[OwnerCounts, ...]
    teachers: int | None
    records: int | None


@dataclass(frozen=True)
class Row:
    """One setting of the table: the worst-case ε of the configured plan under it, and how much
    of the work (``Plan.unit``) fits the reference ε (None: no finite guarantee to fit)."""

    setting: str
    parameters: dict[str, float]
    epsilon: float
    fits: int | None
    configured: bool = False


@dataclass(frozen=True)
class Plan:
    config: str
    pipeline: str
    name: str
    counts: Counts
    work: str  # the planned work in one line
    guarantee: dict[str, Any]  # what privacy.json's "guarantee" would say (Guarantee.as_dict)
    planned_worst_case: float  # ε of the planned work alone, at the same δ
    budget: float | None
    unit: str  # "answers" | "epochs"
    planned: int  # the configured amount of that unit
    reference: str  # the ε the table's "fits" column is measured against
    table: tuple[Row, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)


def add_arguments(parser: argparse.ArgumentParser, command: str = "plan") -> None:
    parser.add_argument("config", help="a run's YAML config (see configs/); nothing it names is read")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--propose", nargs="?", const="-", default=None, metavar="FILE",
                        help="propose a pipeline and its settings from public figures (declared records, classes, "
                             "columns, the public pool's size, the budget) and print the complete config (or write "
                             "it to FILE) for conclave run")
    parser.add_argument("--source", choices=CHOICES, default=None,
                        help="with --propose: size this one instead of plan's choice: dpsgd (DP-SGD across the "
                             "owners) or a vote source (clusters, knn, teachers)")


def main(args: argparse.Namespace) -> int:
    try:
        raw = load_yaml(args.config)
        if "pipeline" not in raw and "base" in raw:
            raise PlanError(f"{args.config} is a sweep (conclave tune); plan takes a run config, "
                            "such as its base (whose trials compose)")
        if args.propose is not None:
            return _propose(args, raw)
        plan = make_plan(args.config, load_pipeline(raw))
    except (ConfigError, PlanError) as err:
        return fail(err)
    except ValueError as err:  # a setting the accounting refuses, e.g. a target ε no noise reaches
        return fail(PlanError(f"{args.config}: {err}"))
    print(json.dumps(_jsonable(plan)) if args.json else summary(plan))
    return 0


def _propose(args: argparse.Namespace, raw: dict[str, Any]) -> int:
    """The proposal as a complete config: on stdout, or in ``args.propose`` (one line says where)."""
    proposal = propose(raw, args.source)
    text = render(raw, proposal, args.config)
    if args.propose == "-":
        print(text, end="")
    else:
        try:
            Path(args.propose).write_text(text)
        except OSError as err:
            raise PlanError(f"--propose {args.propose}: {err.strerror or err}") from err
        print(f"{args.propose}: {proposal.choice} ({proposal.reason}): {proposal.rule}; planned guarantee ε "
              f"{proposal.guarantee.epsilon:.4g} (conclave run {args.propose})")
    for warning in proposal.warnings:
        print(f"conclave: warning: {warning}", file=sys.stderr)
    return 0


def make_plan(path: str, pipeline: Pipeline) -> Plan:
    """The plan of ``pipeline``, from public settings only."""
    if pipeline.name == "teacher_student":
        return _teacher_student(path, pipeline)
    return _dp_sgd(path, pipeline)


# --- what fits --------------------------------------------------------------------------


def _fitting(config: Any, planned_of: Callable[[Any, int], PrivacyCharge], reference: float | None
             ) -> Callable[[int], bool]:
    """Whether ``n`` of the work fits: under ``config``'s budget, at the order its filter takes
    from its planned work (as the ledger would enforce it), else within ``reference``."""
    planned = planned_of(config, -1)
    budget: RenyiFilter | None = config.privacy.budget_filter(planned)
    if budget is None:
        delta = config.privacy.delta

        def within(n: int) -> bool:
            # The worst case is the smaller of the RDP and the PLD figure: where RDP's alone fits,
            # the PLD (a numerical composition, about a second) need not be composed.
            charge = planned_of(config, n)
            return (worst_case_guarantee(dataclasses.replace(charge, pld=None), delta).epsilon <= reference
                    or worst_case_guarantee(charge, delta).epsilon <= reference)

        return within
    index = order_index(budget.order, planned.orders)

    def fits(n: int) -> bool:
        charge = planned_of(config, n)
        return budget.admits(float(charge.rdp[index]), charge.extra_delta)

    return fits


def _largest(fits: Callable[[int], bool], low: int, cap: int) -> int:
    """The largest n in [low, cap] that fits (fitting holds up to some n and not beyond), or
    low − 1 if none does: doubling, then bisection."""
    if not fits(low):
        return low - 1
    good, probe = low, max(2 * low, 1)
    while probe <= cap and fits(probe):
        good, probe = probe, 2 * probe
    bad = min(probe, cap + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _reference(config: Any, planned: PrivacyCharge) -> tuple[float | None, str]:
    """The ε the table fits work into: the budget, else the configured plan's worst case."""
    if config.privacy.budget is not None:
        return None, (f"the budget ε = {config.privacy.budget:g} (a Rényi filter at the order each setting's "
                      "plan fixes)")
    epsilon = worst_case_guarantee(planned, config.privacy.delta).epsilon
    if not math.isfinite(epsilon):
        return None, "no finite ε: the configured plan has no finite guarantee"
    return epsilon, f"the configured plan's worst-case ε = {epsilon:.4g} (no budget declared)"


def _rows(config: Any, settings: list[tuple[str, dict[str, float], Any]],
          planned_of: Callable[[Any, int], PrivacyCharge], low: int, cap: int) -> tuple[Row, ...]:
    """One row per (label, parameters, config of that setting); the first is the configured one."""
    reference, _ = _reference(config, planned_of(config, -1))
    bounded = config.privacy.budget is not None or reference is not None
    rows = []
    for number, (label, parameters, setting) in enumerate(settings):
        epsilon = worst_case_guarantee(planned_of(setting, -1), config.privacy.delta).epsilon
        fits = _largest(_fitting(setting, planned_of, reference), low, cap) if bounded and math.isfinite(epsilon) \
            else None
        rows.append(Row(label, parameters, epsilon, fits, configured=number == 0))
    return tuple(rows)


def _scaled(parameters: dict[str, float], names: tuple[str, ...], factor: float) -> dict[str, float]:
    return {**parameters, **{name: parameters[name] * factor for name in names}}


def _label(parameters: dict[str, float], names: tuple[str, ...], note: str) -> str:
    return ", ".join(f"{name} {parameters[name]:.4g}" for name in names) + f" ({note})"


# --- teacher_student --------------------------------------------------------------------

def _vote_settings(config: Any) -> list[tuple[str, dict[str, float], Any]]:
    """The configured setting, then the neighbouring noise settings the mechanism names
    (``VoteMechanism.noise_variations``; the configured row only for one that names no noise)."""
    mechanism = config.mechanism.instance
    parameters = parameters_of(mechanism)
    shown = mechanism.noise or tuple(parameters)
    settings = [(_label(parameters, shown, "configured"), parameters, config)]
    for names, factor in mechanism.noise_variations(NOISE_FACTORS):
        varied = _scaled(parameters, names, factor)
        try:
            setting = dataclasses.replace(config, mechanism=MechanismConfig(config.mechanism.name, varied))
        except ValueError:  # one the config refuses (owners' gateways admit one σ for every round)
            continue
        note = f"×{factor:g}" if names == shown else f"{'/'.join(names)} ×{factor:g}"
        settings.append((_label(varied, shown, note), varied, setting))
    return settings


def _teacher_student(path: str, pipeline: Pipeline) -> Plan:
    config = pipeline.config
    planned = pipeline.plan()
    guarantee = config.privacy.guarantee(planned)
    voting = config.vote_source.records_vote  # records that vote themselves: no teacher is trained
    owners = tuple(owner_counts(o, None if voting else o.teachers, config, planned) for o in config.owners)
    if owners:
        records = None if any(o.records is None for o in owners) else sum(o.records for o in owners)
    else:
        records = config.data.private_size
    counts = Counts(owners, None if voting else config.num_teachers, records)
    student = config.student
    mechanism = config.mechanism.instance
    # With aggregation: secure the noise is the secure variant's (Skellam through the secure sum).
    runs = config.vote_mechanism.name
    described = ", ".join(f"{k} {v:g}" for k, v in parameters_of(mechanism).items())
    work = config.vote_source.work(config, f"{runs} ({described})")
    if config.smooth_sensitivity() is not None:
        work += ", plus the smooth-sensitivity release (charged before the first query)"

    def planned_of(setting: Any, answers: int) -> PrivacyCharge:
        return setting.planned() if answers < 0 else setting.planned(answers)

    table = _rows(config, _vote_settings(config), planned_of, 0, MAX_ANSWERS)
    warnings = [*mechanism.warnings(counts.teachers), *_record_warnings(counts, config.data.private_size),
                *_budget_warnings(config, planned, table, "answers", student.queries)]
    return _plan(path, "teacher_student", config, counts, work, guarantee, planned, "answers", student.queries,
                 table, warnings)


def _record_warnings(counts: Counts, benchmark_records: int | None) -> list[str]:
    """Teachers that would each learn from fewer than ``RECORDS_PER_TEACHER`` declared records."""
    shares = [(o.name, o.records, o.teachers) for o in counts.owners if o.records is not None and o.teachers]
    if not counts.owners and benchmark_records is not None and counts.teachers:
        shares.append(("data.private_size", benchmark_records, counts.teachers))
    few = [f"{who} {records / teachers:.3g}" for who, records, teachers in shares
           if records / teachers < RECORDS_PER_TEACHER]
    if not few:
        return []
    return [f"fewer than {RECORDS_PER_TEACHER} declared records per teacher ({', '.join(few)}): each teacher "
            "learns from too little to vote well; fewer teachers, or more records"]


def _budget_warnings(config: Any, planned: PrivacyCharge, table: tuple[Row, ...], unit: str, amount: int
                     ) -> list[str]:
    if config.privacy.budget is None or table[0].fits is None or table[0].fits >= amount:
        return []
    epsilon = worst_case_guarantee(planned, config.privacy.delta).epsilon
    if unit == "answers":
        return [f"the budget ε = {config.privacy.budget:g} admits {table[0].fits} of the {amount} planned answers "
                f"in the worst case (the planned work's ε = {epsilon:.4g}): the aggregator refuses the batch that "
                f"could pass it ({config.mechanism.instance.budget_note})"]
    return [f"the planned work's worst case ε = {epsilon:.4g} exceeds the budget ε = {config.privacy.budget:g}, "
            f"which admits {table[0].fits} of the {amount} planned epochs: the ledger refuses the charge that would "
            "pass it"]


# --- DP-SGD (active_learning, sparse_finetune) -------------------------------------------


def _dp_sgd(path: str, pipeline: Pipeline) -> Plan:
    from conclave.learning.dp_schedule import dp_schedule

    config = pipeline.config
    active_learning = pipeline.name == "active_learning"
    if active_learning and config.checkpoints_from is not None:
        raise PlanError("checkpoints_from: the training cost is that of an earlier run's checkpoints, which plan "
                        "does not read (that run's privacy.json states it)")
    if not active_learning and not config.owners and config.private.size is None:
        raise PlanError("private.size: not declared, so the DP-SGD schedule's N would be counted from the "
                        "benchmark's files; plan reads no data: declare it")
    section = "dpsgd" if active_learning else "finetune"
    planned = pipeline.plan()
    guarantee = config.privacy.guarantee(planned)
    dp = config.dpsgd if active_learning else config.finetune
    schedule = dp_schedule(config.private_size, dp.dp_config(config.privacy.delta), secure=config.secure_training,
                           screen_steps=dp.screen_steps if active_learning else 0)
    counts = Counts(tuple(owner_counts(o, None, config, planned) for o in config.owners), None, config.private_size)
    steps_per_epoch = round(1 / schedule.sample_rate)
    how = f"calibrated to target ε {dp.target_epsilon:g}" if dp.target_epsilon is not None else "configured"
    summed = "secure sums across the owners' gateways" if config.owners else "secure sums across shard actors"
    work = (f"DP-SGD on N = {config.private_size} declared records, expected batch {dp.batch_size}: q = "
            f"1/{steps_per_epoch}, {steps_per_epoch} steps per epoch, {dp.epochs} epochs ({schedule.steps} steps), "
            f"noise multiplier {schedule.noise_multiplier:.4g} ({how}), "
            f"{f'{summed} (Skellam)' if schedule.secure else 'one holder (Gaussian)'}")
    if schedule.screen_steps:
        work += (f"; first a screening run of {schedule.screen_steps} steps (logistic regression at the same q and "
                 f"noise) choosing the columns the model reads")
    if not active_learning:
        work += f"; {len(config.finetune.variants)} variants, one schedule each, on the same records"
    elif config.selection_releases():
        work += (f"; NearPrivate's DP-PCA (ε {config.selection.epsilon_pca:g}) and noisy counts "
                 f"(ε {config.selection.epsilon_support:g})")

    def with_dp(setting: Any, **changes: Any) -> Any:
        return dataclasses.replace(setting, **{section: dataclasses.replace(getattr(setting, section), **changes)})

    def planned_of(setting: Any, epochs: int) -> PrivacyCharge:
        return pipeline.with_config(setting if epochs < 0 else with_dp(setting, epochs=epochs)).plan()

    # σ fixed at the schedule's (a target ε would recalibrate it for every number of epochs)
    sigma = schedule.noise_multiplier
    settings = [(f"noise multiplier {sigma:.4g} (configured)", {"noise_multiplier": sigma},
                 with_dp(config, noise_multiplier=sigma, target_epsilon=None))]
    for factor in NOISE_FACTORS:
        varied = sigma * factor
        settings.append((f"noise multiplier {varied:.4g} (×{factor:g})", {"noise_multiplier": varied},
                         with_dp(config, noise_multiplier=varied, target_epsilon=None)))
    table = _rows(config, settings, planned_of, 1, MAX_EPOCHS)
    warnings = _budget_warnings(config, planned, table, "epochs", dp.epochs)
    if schedule.sample_rate >= 1:
        warnings.append(f"the expected batch ({dp.batch_size}) is at least the {config.private_size} declared records: "
                        "every step uses them all, so sampling amplifies nothing")
    return _plan(path, pipeline.name, config, counts, work, guarantee, planned, "epochs", dp.epochs, table, warnings)


def _plan(path: str, pipeline: str, config: Any, counts: Counts, work: str, guarantee: Guarantee,
          planned: PrivacyCharge, unit: str, amount: int, table: tuple[Row, ...], warnings: list[str]) -> Plan:
    _, reference = _reference(config, planned)
    if guarantee.unsound_reasons:
        warnings.append("NOT SOUND: " + "; ".join(guarantee.unsound_reasons))
    return Plan(path, pipeline, config.name, counts, work, guarantee.as_dict(),
                worst_case_guarantee(planned, config.privacy.delta).epsilon, config.privacy.budget, unit, amount,
                reference, table, tuple(warnings))


# --- output -----------------------------------------------------------------------------


def summary(plan: Plan) -> str:
    """The plan for a person: counts, work, the guarantee, the table, the warnings."""
    counts = plan.counts
    declared = [f"{len(counts.owners)} owners" if counts.owners else "a benchmark's data (no owners)"]
    if counts.teachers is not None:
        declared.append(f"{counts.teachers} teachers")
    declared.append(f"{counts.records} records" if counts.records is not None else "records not declared")
    lines = [f"{plan.name} ({plan.pipeline}), from {plan.config}: nothing read but the config",
             f"  declared    {', '.join(declared)}"]
    for owner in counts.owners:
        parts = ([f"{owner.teachers} teachers"] if owner.teachers is not None else []) + \
            [f"{owner.records} records" if owner.records is not None else "records not declared"]
        if owner.lifetime is not None:
            parts.append(f"lifetime ε {owner.lifetime:g}: pays for {owner.runs_per_lifetime} runs like this one "
                         "from a fresh ledger")
        lines.append(f"              {owner.name}: {', '.join(parts)}")
    guarantee = plan.guarantee
    lines += [f"  work        {plan.work}",
              f"  guarantee   ε = {_number(guarantee['epsilon'])} at δ = {guarantee['delta']:g} "
              f"({guarantee['basis']}), as privacy.json would state it",
              f"              planned work's worst case ε = {_number(plan.planned_worst_case)}; budget "
              f"{'none' if plan.budget is None else f'ε = {plan.budget:g}'}",
              f"  what fits   {plan.unit} within {plan.reference}"]
    width = max(len(row.setting) for row in plan.table)
    lines.append(f"    {'setting':<{width}}  {'worst-case ε':>12}  {plan.unit + ' that fit':>16}")
    for row in plan.table:
        fits = "-" if row.fits is None else (f"≥ {row.fits}" if row.fits >= _cap(plan.unit) else str(row.fits))
        lines.append(f"    {row.setting:<{width}}  {_number(row.epsilon):>12}  {fits:>16}")
    lines.append(f"    (planned: {plan.planned} {plan.unit})")
    lines += [f"  warning     {warning}" for warning in plan.warnings]
    return "\n".join(lines)


def _cap(unit: str) -> int:
    return MAX_ANSWERS if unit == "answers" else MAX_EPOCHS


def _number(value: float) -> str:
    return "inf" if not math.isfinite(value) else f"{value:.4g}"
