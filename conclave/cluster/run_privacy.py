"""A run's privacy section, trust model and report, shared by every pipeline of the library.

``PrivacyConfig`` is the budget declared before the run, δ and where noise comes from; it opens
the run's ledger and states its guarantee. ``TrustModel`` says who sees un-noised values
computed from other parties' records (docs/privacy.md, "Who sees what"). ``RunPrivacy`` is what
a run reports (``privacy.json``): the ``Guarantee`` first, then labelled ``Estimate``s and what
the pipeline released besides.

Owners keep their lifetime ledgers behind their gateways, each admitting a run by its own policy and
charging its own ledger first: a run's report lists each one's account as its gateway reports it
(``GatewayAccount``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from conclave.cluster.config import ConfigError
from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, filter_for
from conclave.privacy.accounting.guarantee import Estimate, Guarantee, covers, run_guarantee, worst_case_guarantee
from conclave.privacy.accounting.ledger import AnsweringLedger, BudgetReport, PrivacyLedger
from conclave.privacy.accounting.owner_policy import budget_statement
from conclave.privacy.noise import NoisePolicy


@dataclass(frozen=True)
class PrivacyConfig:
    """A config's ``privacy`` section: the budget declared before the run, δ, and where noise comes from.

    ``budget``: the ε the run may spend at ``delta``, enforced by the ledger as a Rényi
    filter at an order chosen from the planned work (``privacy.accounting.filter``); null
    for no budget, when the guarantee is the worst case of the planned work alone.
    ``insecure_noise_seed``: reproducible DP noise for debugging — every report of such a
    run says ``sound: false``. Never set it for a result you publish.
    """

    budget: float | None = None
    delta: float = 1e-5
    insecure_noise_seed: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and not (self.budget > 0 and math.isfinite(self.budget)):
            raise InvalidValue(f"privacy.budget must be a finite number > 0 or null, got {self.budget}")
        if not 0 < self.delta < 1:
            raise InvalidValue(f"privacy.delta must be in (0, 1), got {self.delta}")

    @property
    def noise(self) -> NoisePolicy:
        return NoisePolicy(insecure_seed=self.insecure_noise_seed)

    def require_os_entropy(self, use: str) -> None:
        """Refuse reproducible noise for a ``use`` whose output cannot carry ``sound: false``
        (a served answer; a sweep's winner, whose number of trials the seed would fix)."""
        if self.insecure_noise_seed is not None:
            raise ConfigError(f"privacy.insecure_noise_seed: {use} draws noise from OS entropy only; remove the seed")

    def budget_filter(self, planned: PrivacyCharge) -> RenyiFilter | None:
        """The filter this run declares for its planned worst-case work (None without a budget)."""
        if self.budget is None:
            return None
        try:
            return filter_for(planned, self.budget, self.delta)
        except ValueError as err:
            raise InvalidValue(f"privacy.budget: {err}") from None

    def open_ledger(self, path: str | Path, planned: PrivacyCharge, durable: bool = False) -> PrivacyLedger:
        """The run's ledger, its budget (if any) fixed now from ``planned``, before any data is read.
        ``durable``: a ledger that outlives the run (a service's, a results folder's that later
        runs keep charging): its length and last checksum are kept outside the file too, so
        deleting, emptying or shortening it is refused (``ledger_records``)."""
        return PrivacyLedger(path, self.delta, self.budget_filter(planned), neighbouring=planned.neighbouring,
                             keep_record=durable)

    def guarantee(self, planned: PrivacyCharge) -> Guarantee:
        """The run's guarantee: the budget or the planned worst case, whichever is smaller."""
        reasons = (self.noise.unsound_reason,) if self.noise.unsound_reason else ()
        return run_guarantee(planned, self.delta, self.budget_filter(planned), reasons)

    def report(self, planned: PrivacyCharge, ledger: AnsweringLedger, trust: TrustModel) -> RunPrivacy:
        """What every run reports about its privacy: the guarantee (the better of the budget
        ``ledger`` enforces and the worst case of ``planned`` — or, where the ledger's charges at
        their worst cases went past it, e.g. a round charged, given up and asked again, of those
        charges: ``run_guarantee``), who saw what, what was planned and what the ledger holds (the
        pipeline adds its own releases, and the owners' lifetime accounts: ``with_owner_accounts``)."""
        reasons = (self.noise.unsound_reason,) if self.noise.unsound_reason else ()
        charged = ledger.worst_case_spent()
        # the filter the ledger enforces; the plan's worst case or, past it, what was charged
        guarantee = run_guarantee(planned, self.delta, ledger.budget, reasons, charged)
        plan, spent = worst_case_guarantee(planned, self.delta), ledger.report()
        beyond = None if covers(planned, charged) else (
            f"the run charged more than its plan ({spent.charges} charges at worst case ε "
            f"{worst_case_guarantee(charged, self.delta).epsilon:.4g} against the plan's ε {plan.epsilon:.4g}, e.g. a "
            "round given up at its deadline and asked again): the guarantee composes every charge at its worst case")
        return RunPrivacy(guarantee, trust, plan, planned.label, spent, beyond_plan=beyond)


class Aggregation(StrEnum):
    """How values computed from several parties' records are added up (docs/privacy.md, "Who
    sees what"); the value is how configs and ``privacy.json`` name it."""

    # The aggregator sees every teacher's clean vote (PATE's classic trust).
    TRUSTED_AGGREGATOR = "trusted-aggregator"
    # Every sum across owners' gateways or shard actors is a secure sum with distributed noise, so whoever
    # sums (and every owner) sees only noised totals (teacher votes too, with ``aggregation: secure``).
    SECURE = "secure"
    # One actor holds all the private data, so nothing private crosses between processes but DP releases.
    SINGLE_HOLDER = "single-holder"


@dataclass(frozen=True)
class TrustModel:
    """Who sees un-noised values computed from other parties' records in a run (docs/privacy.md,
    "Who sees what"), and how they are added up (``aggregation``); written to ``privacy.json``.
    The guarantee holds against everyone else, and against these parties only as far as
    ``statement`` says."""

    aggregation: Aggregation
    trusted: tuple[str, ...]  # parties that see clean values of data not their own
    statement: str

    def as_dict(self) -> dict[str, Any]:
        return {"aggregation": self.aggregation, "trusted": list(self.trusted), "statement": self.statement}


TRUSTED_AGGREGATOR = TrustModel(
    Aggregation.TRUSTED_AGGREGATOR, ("the aggregator",),
    "the aggregator (in the driver's process) sees every teacher's clean vote on each query; each owner's "
    "actors see only that owner's records and teachers; students and outsiders see released labels only")
KNN_AGGREGATOR = TrustModel(
    Aggregation.TRUSTED_AGGREGATOR, ("the aggregator",),
    "one owner, whose node also runs the aggregator: the aggregator (in the driver's process) sees, for each "
    "query, the squared distances and labels of the k nearest sampled records (in the public embedding) and the "
    "clean vote histogram they make — enough to locate records, so it never runs across owners; students and "
    "outsiders see released labels only")
CLUSTER_AGGREGATOR = TrustModel(
    Aggregation.TRUSTED_AGGREGATOR, ("the aggregator",),
    "one owner, whose node also runs the aggregator: the aggregator (in the driver's process) sees the clean "
    "histogram of the records' votes for the medoids; students and outsiders see released labels only")
SECURE_SUMS = TrustModel(
    Aggregation.SECURE, (),
    "the owners' gateways (or a benchmark's shard actors) add up clipped gradients (and NearPrivate's sums) only "
    "through secure sums: each sends a masked share with its noise share in it, so whoever sums, and every owner, "
    "sees only noised totals; the driver sees DP releases only")
SECURE_VOTES = TrustModel(
    Aggregation.SECURE, (),
    "each owner's vote actors (teachers, kNN or public-cluster shards) count their votes on the owner's node "
    "and send only a masked share of their vote histograms with their Skellam noise share in it, so the "
    "aggregator (in the driver's process) sees only noised vote totals — no distance, neighbour or per-owner "
    "histogram — and each owner's actors see only the public inputs; students and outsiders see released "
    "labels only")
SINGLE_HOLDER = TrustModel(
    Aggregation.SINGLE_HOLDER, (),
    "one actor holds all the private data and adds the noise itself; nothing computed from the records "
    "leaves it but DP releases")


def dp_sgd_trust(secure: bool) -> TrustModel:
    """The trust model of a DP-SGD run: secure sums across several shard actors, else one holder."""
    return SECURE_SUMS if secure else SINGLE_HOLDER


SPENT_NOTE = "realised spend: a function of what was released, not the guarantee"


@dataclass(frozen=True)
class RunPrivacy:
    """A run's privacy report: the guarantee a theorem backs (``guarantee``), who saw what
    (``trust``), the worst case of the planned work, what the ledger holds (``spent``, an
    odometer reading, not the guarantee), labelled ``estimates`` that are not guarantees, the
    guarantee of each model the run publishes on its own (``per_model``), why the planned
    worst case does not cover the run where it does not (``beyond_plan``), and the pipeline's
    own public figures (``releases``: its mechanism, DP-SGD schedule, NearPrivate's releases...).
    Only public values go in: ``as_dict`` is ``privacy.json``."""

    guarantee: Guarantee
    trust: TrustModel
    planned: Guarantee  # the worst case of the planned work
    planned_label: str
    spent: BudgetReport
    estimates: tuple[Estimate, ...] = ()
    per_model: Mapping[str, Guarantee] = field(default_factory=dict)
    releases: Mapping[str, Any] = field(default_factory=dict)
    owners: Mapping[str, GatewayAccount] = field(default_factory=dict)  # their lifetime accounts
    beyond_plan: str | None = None  # why the plan's worst case is not the guarantee: the run charged more

    @property
    def epsilon(self) -> float:
        return self.guarantee.epsilon

    @property
    def sound(self) -> bool:
        return self.guarantee.sound

    def adding(self, estimates: tuple[Estimate, ...] = (), per_model: Mapping[str, Guarantee] | None = None,
               **releases: Any) -> RunPrivacy:
        """This report with more estimates, per-model guarantees and releases. An estimate
        computed from private data without a mechanism never goes into a run's report."""
        if any(e.private for e in estimates):
            raise InvalidValue("a run's privacy report holds public estimates only")
        return dataclasses.replace(self, estimates=self.estimates + tuple(estimates),
                                   per_model={**self.per_model, **(per_model or {})},
                                   releases={**self.releases, **releases})

    def with_owner_accounts(self, accounts: Mapping[str, GatewayAccount]) -> RunPrivacy:
        """This report with the owners' lifetime accounts after the run (as their gateways report them)."""
        return dataclasses.replace(self, owners={**self.owners, **accounts})

    def headline(self) -> str:
        """One line: the run's guarantee, why it is not sound if it is not, and the estimates,
        labelled (owners' lifetime accounts: ``owners_line``)."""
        g = self.guarantee
        line = (f"guarantee ε = {g.epsilon:.3g} at δ = {g.delta:g} ({g.basis})" if math.isfinite(g.epsilon)
                else "guarantee ε = inf: no finite guarantee")
        if g.unsound_reasons:
            line += "; NOT SOUND: " + "; ".join(g.unsound_reasons)
        if self.beyond_plan is not None:
            line += "; the run charged more than its plan"
        for estimate in self.estimates:
            if estimate.epsilon is not None:
                line += f"; {estimate.name} estimate ε = {estimate.epsilon:.3g} (not a DP guarantee)"
        return line

    def owners_line(self) -> str:
        """One line: each budgeted owner's lifetime guarantee and how much of it is spent."""
        return "; ".join(f"{name}: {account.headline()}" for name, account in self.owners.items())

    def as_dict(self) -> dict[str, Any]:
        spent = self.spent
        report: dict[str, Any] = {
            "guarantee": self.guarantee.as_dict(),
            "sound": self.sound,
            "unsound_reasons": list(self.guarantee.unsound_reasons),
            "delta": self.guarantee.delta,
            "aggregation": self.trust.aggregation,
            "trust_model": self.trust.as_dict(),
            "budget": None if spent.budget is None else spent.budget.as_dict(),
            "planned_worst_case": {"epsilon": self.planned.epsilon, "charge": self.planned_label,
                                   "covers_the_run": self.beyond_plan is None,
                                   **({} if self.beyond_plan is None else {"note": self.beyond_plan})},
            "spent": {"epsilon": spent.epsilon_spent, "order": spent.order, "charges": spent.charges,
                      "by_label": spent.by_label, "rdp_at_budget_order": spent.rdp_at_budget_order,
                      "note": SPENT_NOTE},
            "estimates": [e.as_dict() for e in self.estimates],
        }
        if self.per_model:
            report["per_model"] = {name: g.as_dict() for name, g in self.per_model.items()}
        if self.owners:
            report["owners"] = {name: account.as_dict() for name, account in self.owners.items()}
        return {**report, **self.releases}


LIFETIME_COVERS = ("every release computed from this owner's data in every run charged to its ledger, this run's "
                   "included: the lifetime budget is a Rényi filter over all of them")


@dataclass(frozen=True)
class GatewayAccount:
    """An owner's lifetime account after a run, as its gateway reports it (``Budget``): the lifetime
    budget in force on its machine (a Rényi filter over every release from its data, in every run), what
    its ledger has spent (a realised figure, not the guarantee), its charges and how many it held before
    this run. ``budget_source``: where that budget comes from, where the run knows it (gateways it
    started on this machine: the owner's "policy", or the run's "config"; None: the owner's business)."""

    owner: str
    epsilon: float
    delta: float
    spent_epsilon: float
    charges: int
    charges_before_run: int
    budget_source: str | None = None

    def headline(self) -> str:
        charges = f"{self.charges} charge" + ("" if self.charges == 1 else "s")
        return (f"ε {self.epsilon:g} lifetime, {self.spent_epsilon:.3g} spent over {charges} "
                f"({self.charges_before_run} before this run)")

    def as_dict(self) -> dict[str, Any]:
        account: dict[str, Any] = {
            "guarantee": {"epsilon": self.epsilon, "delta": self.delta, "basis": "renyi-filter"},
            "covers": LIFETIME_COVERS, "ledger": "kept by the owner's gateway, on its machine",
            "spent": {"epsilon": self.spent_epsilon, "charges": self.charges,
                      "charges_before_run": self.charges_before_run, "note": SPENT_NOTE}}
        if self.budget_source is not None:
            account["budget_source"] = {"source": self.budget_source, "statement": budget_statement(self.budget_source)}
        return account
