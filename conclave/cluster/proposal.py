"""Settings proposed for a consortium's run, from public figures alone (``conclave plan CONFIG --propose``).

It reads the config and the public tables' sizes, never an owner's file, so the proposal releases
nothing, and the same declared figures always give the same proposal. It chooses the pipeline
(``choose``): for tables, DP-SGD across the owners (their model is the result) wherever the
declared records pay for its model's parameters at the budget, else public-cluster votes; for
images, public-cluster votes. On public proxies (``bench/proposal_proxy.py``: the consortium
benchmark's shapes at other seeds, scikit-learn's breast-cancer and digits) DP-SGD's model beat the
student of public clusters, the best vote source, by 13–30 points on the consortium shapes at ε 1
and 4, and was within a point of it or above on the small tables; on large tables a DP screening run first
picks the columns the quadratic model reads (``SCREEN_RECORDS``). ``--source`` sizes another.
Every noise level is calibrated by the accounting a run uses, so the proposed run is never cut
short by its own filter. The sizing rules are the constants below, each with its reason.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from conclave.cluster.config import ConfigError
from conclave.cluster.teaching.config import TeacherStudentConfig, MechanismConfig
from conclave.privacy.accounting.filter import order_index
from conclave.privacy.accounting.guarantee import Guarantee, worst_case_guarantee
from conclave.learning.embeddings import HogPCA, ScatteringPCA, StandardisedPCA
from conclave.privacy.mechanisms.gnmax import GNMax
from conclave.privacy.mechanisms.private_knn import PrivateKnnMechanism
from conclave.privacy.mechanisms.public_clusters import PublicClusterVotes

if TYPE_CHECKING:
    from conclave.cluster.owners import DataOwner
    from conclave.cluster.pipelines import Pipeline

log = logging.getLogger(__name__)

DPSGD = "dpsgd"  # DP-SGD across the owners (pipeline: active_learning, no labels bought): its model is the result
SOURCES = ("clusters", "knn", "teachers")  # the teacher_student vote sources
CHOICES = (DPSGD, *SOURCES)  # what a proposal may be (``--source`` names one)
TEACHER_STUDENT, ACTIVE_LEARNING = "teacher_student", "active_learning"
# What every pipeline's config says alike: the consortium's declaration, carried into any proposal.
DECLARATION = ("name", "seed", "owners", "public", "test", "classes", "privacy", "runtime_env", "tracking")
# Public clusters: a medoid's expected votes at least this many noise deviations ...
VOTE_MARGIN = 10.0
# ... and at most the records per class over this (its voters a small part of one class).
LOCALITY = 4.0
VOTES_PER_RECORD = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50)
COUNT_STEP = 0.9  # fewer clusters, step by step, when no count meets both
CLUSTER_SIGMA_MAX = 1e4  # one Gaussian or Skellam release: ε 1e-5 at m 50 long before this
TABLE_EMBEDDING = (StandardisedPCA.name, 50)  # columns in different units: each scaled by its public spread
IMAGE_EMBEDDING = (HogPCA.name, 50)  # MNIST's purest public-cluster labels (docs/STACK figures)
KNN_IMAGE_EMBEDDING = (ScatteringPCA.name, 32)
# kNN votes (the shipped configs: hospitals-knn, digits-knn at q 0.3; mnist-knn at 0.1)
KNN_FEW_RECORDS = 10_000
KNN_RECORDS_PER_NEIGHBOUR = 20  # k = sampled records / this
KNN_K = (10, 300)
KNN_THRESHOLD_SHARE = 0.7
KNN_NOISE_SHARE = 0.4  # σ at most this share of k (hospitals-knn: σ 4 at k 10)
# Teachers
RECORDS_PER_TEACHER = 20  # as plan's warning: fewer, and a teacher learns too little to vote well
MAX_TEACHERS = 250
TEACHER_NOISE_SHARE = 1 / 3  # σ at most this share of the teachers
MIN_QUERIES = 20
BATCH_SIZE = 20  # the student's calls (teachers, kNN): the budget's tail is spent in small batches
# DP-SGD across the owners (``_dpsgd``), each setting measured on public proxies (bench/proposal_proxy.py)
DPSGD_RECORDS_PER_PARAMETER = 2.0  # declared records × ε per model parameter: below it, the noise swamps the model
# Full-batch noised steps: 25 per unit of ε, within [50, 100]. More steps converge further, each at
# more noise: replayed on the proxies, 100 beat 50 at ε 4 (by 1–4 points) and lost to it at ε 1 (by
# 1–4); 30 or 40 at ε 1, learning rates 0.5–2 and other scalings of the products were level.
DPSGD_STEPS_PER_EPSILON, DPSGD_STEPS = 25, (50, 100)
DPSGD_LR, DPSGD_MOMENTUM, DPSGD_CLIP = 1.0, 0.9, 1.0  # with a cosine decay to 0 (averages the late noise away)
TABLE_MODELS = ("quadratic", "logistic_regression")  # the richest the records pay for first
# DP column screening (``dpsgd.screen_steps``: ``cluster.active_gateways``) before the quadratic model,
# whatever the records pay per quadratic parameter (the noise on a dropped column's parameters changes
# no prediction), for tables of at least SCREEN_RECORDS declared records whose records × ε pay
# SCREEN_RECORDS_PER_PARAMETER per logistic regression parameter. Replayed on the proxies (the budget
# shared by both stages: σ 28.7 → 34 at ε 1, 11.6 → 12.7 at ε 4; 2 runs each), the consortium shapes
# (2,400–5,100 records, 11–100 per logistic parameter) gained 4–10 points at ε 4 and 5–6 at ε 1 over the
# quadratic model, and (c) 6–9 at ε 1 over the logistic regression its records paid for; breast-cancer
# (300 records) lost 3 at ε 4 and 8 at ε 1; digits (1,290 records, 7.9 and 2 per parameter) lost 9 and 24:
# it kept 52–63 of its 64 columns, whose quadratic model its records could not pay for.
SCREEN_RECORDS, SCREEN_RECORDS_PER_PARAMETER = 1000, 10.0
# Screening's steps: 20 full-batch steps of logistic regression at the run's σ, before the 50–100 main
# steps (measured: 20 at ε 1 before 50 main steps, and at ε 4 before 100, as above).
SCREEN_STEPS = 20
SCREEN_KEEP = 0.35  # columns whose weight norm is ≥ this share of the largest (0.35 level with 0.5, or better)
PROPOSED = "-proposed"  # the proposed config's name: the config's, with "-<choice>" and this
SIGMA_DIGITS = 3  # σ rounded up to this many significant digits (up: ε only falls)


class ProposalError(ConfigError):
    """A config no proposal can be made for from public figures; the message is the one line."""


@dataclass(frozen=True)
class PublicFigures:
    """Everything a proposal may depend on: declared and public, never an owner's data."""

    owners: tuple[tuple[str, int], ...]  # (name, declared records)
    classes: int
    pool: int  # rows of the public pool
    table: bool  # table rows (else images)
    width: int  # values per input (a PCA keeps at most this many dimensions)
    epsilon: float  # the budget the proposal fits
    delta: float
    max_batch: int
    secure: bool  # records that vote meet in the secure sum: across owners always, else as configured

    @property
    def records(self) -> int:
        return sum(records for _, records in self.owners)

    @property
    def noise_factor(self) -> float:
        """The total's noise deviation over σ: secure sums of O ≥ 2 owners carry O/(O − 1)·σ²."""
        owners = len(self.owners)
        return math.sqrt(owners / (owners - 1)) if self.secure and owners > 1 else 1.0


@dataclass(frozen=True)
class Proposal:
    """The proposed settings (``sections``: the config's top-level keys they replace, as YAML
    values) and what they plan: the guarantee ``privacy.json`` would state, and the planned work's
    worst case, both at most the budget."""

    choice: str  # one of CHOICES
    figures: PublicFigures
    sections: dict[str, Any]
    guarantee: Guarantee
    planned_worst_case: float
    rule: str  # the sizes and why, in a sentence
    reason: str  # why this pipeline, in a sentence
    warnings: tuple[str, ...] = field(default_factory=tuple)


def load_config(raw: dict[str, Any]) -> Any:
    """The config of a parsed YAML mapping (``teacher_student`` or ``active_learning``), read as a run
    reads it (its ``tracking`` section says how a run is recorded, not what it does)."""
    from conclave.cluster.pipelines import load_pipeline

    if raw.get("pipeline") not in (TEACHER_STUDENT, ACTIVE_LEARNING):
        raise ProposalError(f"--propose sizes a consortium's teacher_student or active_learning config, not "
                            f"{raw.get('pipeline')}")
    return load_pipeline(raw).config


def as_pipeline(raw: dict[str, Any], pipeline: str) -> dict[str, Any]:
    """``raw`` as a config of ``pipeline``: itself, or its declaration (``DECLARATION``: the owners,
    public data and budget) under the other pipeline's name, each owner without its teachers."""
    if raw.get("pipeline") == pipeline:
        return raw
    declared = {key: raw[key] for key in DECLARATION if key in raw}
    owners = [{key: value for key, value in owner.items() if key != "teachers"} for owner in raw.get("owners") or ()]
    return {"pipeline": pipeline, **declared, **({"owners": owners} if owners else {})}


def public_figures(raw: dict[str, Any]) -> PublicFigures:
    """The figures of the config ``raw`` (owners with declared records), reading only its public
    pool and test tables (their row count, kind and class list)."""
    from conclave.cluster.owners import PublicData

    load_config(raw)  # a config a run would refuse is refused here, in one line
    config: TeacherStudentConfig = load_config(as_pipeline(raw, TEACHER_STUDENT))
    if not config.owners:
        raise ProposalError("--propose sizes a run from its owners' declared records: the config names no owners")
    undeclared = [owner.name for owner in config.owners if owner.records is None]
    if undeclared:
        raise ProposalError(f"--propose sizes a run from declared records: owner(s) {', '.join(undeclared)} "
                            "declare no records (a public upper bound of what each holds)")
    if config.privacy.budget is None:
        raise ProposalError("--propose fits the noise to privacy.budget: declare one (the ε the run may spend)")
    _started_gateways_admit(config.owners)
    try:
        public = PublicData.read(config.public, config.test, config.classes)
    except (ValueError, OSError) as err:
        raise ProposalError(f"public/test: {err}") from err
    several = len(config.owners) > 1
    return PublicFigures(tuple((owner.name, int(owner.records)) for owner in config.owners), len(public.classes),
                         len(public.splits.public), public.schema.kind == "table", math.prod(public.schema.shape),
                         float(config.privacy.budget),
                         config.privacy.delta, config.server.max_batch, config.secure or several)


def _started_gateways_admit(owners: Sequence[DataOwner]) -> None:
    """The owners named by their data have a budget (a policy on this machine or the config's), as
    the gateways a run starts for them require: else the proposal would not run as written."""
    from conclave.cluster.gateway.local import budget_source
    from conclave.privacy.accounting.owner_policy import OwnerRefused

    for owner in owners:
        if owner.data is not None:
            try:
                budget_source(owner)
            except OwnerRefused as err:
                raise ProposalError(f"{err} (conclave run refuses it)") from None


def choose(figures: PublicFigures) -> tuple[str, str]:
    """The pipeline for ``figures`` (one of ``CHOICES``) and why, from public figures alone
    (module docstring; the proxies' figures are in ``results/bench/proposal_proxy.json``)."""
    if not figures.table:
        return "clusters", ("images: public-cluster votes in a HOG embedding, one release labelling the whole pool "
                            "(DP-SGD from scratch on images learns far less at these budgets)")
    model = dpsgd_model(figures)
    if model is None:
        return "clusters", (f"a table whose {figures.records} declared records pay at ε {figures.epsilon:g} for no "
                            f"DP-SGD model's parameters ({DPSGD_RECORDS_PER_PARAMETER:g} records × ε each): public-"
                            "cluster votes, one release whatever the model")
    return DPSGD, ("a table: DP-SGD across the owners, whose model was well above the best vote source's student "
                   "(public clusters) on public proxies of consortium tables and within a point of it or above on "
                   "small ones (bench/proposal_proxy.py), wherever the declared records paid for its parameters")


def propose(raw: dict[str, Any], choice: str | None = None) -> Proposal:
    """Settings for the consortium's config ``raw`` (a parsed YAML mapping with owners, of the
    ``teacher_student`` or ``active_learning`` pipeline) as ``choice`` (one of ``CHOICES``; None:
    ``choose``'s, from the public figures)."""
    if choice is not None and choice not in CHOICES:
        raise ProposalError(f"source must be one of {', '.join(CHOICES)}, got {choice!r}")
    figures = public_figures(raw)
    reason = f"asked for (--source {choice})" if choice else ""
    if choice is None:
        choice, reason = choose(figures)
    pipeline = ACTIVE_LEARNING if choice == DPSGD else TEACHER_STUDENT
    base = as_pipeline(raw, pipeline)
    size = {DPSGD: _dpsgd, "clusters": _clusters, "knn": _knn, "teachers": _teachers}[choice]
    sections, rule, warnings = size(base, figures)
    # its own results folder beside the config's; the pipeline named where it is not the user's
    sections = {**({"pipeline": pipeline} if base is not raw else {}),
                "name": proposed_name(str(raw.get("name", pipeline)), choice), **sections}
    proposed = _base(base, sections)  # as `conclave run` will read it
    planned = proposed.plan()
    worst = worst_case_guarantee(planned, figures.delta).epsilon
    if not (worst <= figures.epsilon and _admitted(proposed)):  # the calibration's promise, checked as a run would
        raise ProposalError(f"the proposed {choice} settings plan ε {worst:.4g}, past the budget {figures.epsilon:g}")
    log.debug("proposed %s for %s: %s", choice, raw.get("name"), rule)
    return Proposal(choice, figures, sections, proposed.config.privacy.guarantee(planned), worst, rule, reason,
                    tuple(warnings))


def proposed_name(name: str, choice: str) -> str:
    """The proposed run's name: ``<name>-<choice>-proposed``, so that each choice's proposal has
    its own results folder; proposing again for a proposed config replaces its choice."""
    for known in CHOICES:
        if name.endswith(f"-{known}{PROPOSED}"):
            name = name[:-len(f"-{known}{PROPOSED}")]
            break
    return f"{name}-{choice}{PROPOSED}"


def proposed_config(raw: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """``raw`` as the proposal's pipeline (``as_pipeline``) with the proposal's sections in place of
    its own (and no other vote source's)."""
    raw = as_pipeline(raw, sections.get("pipeline", raw.get("pipeline")))
    merged = {key: value for key, value in raw.items() if key not in ("knn", "clusters", *sections)}
    return {**merged, **sections}


def render(raw: dict[str, Any], proposal: Proposal, source_path: str) -> str:
    """The complete proposed config as YAML: the user's keys, then the proposed sections under a
    comment saying where they came from (paste those into a config of your own, or run this)."""
    figures = proposal.figures
    merged = proposed_config(raw, proposal.sections)
    kept = {key: value for key, value in merged.items() if key not in proposal.sections}
    owners = ", ".join(f"{name} {records}" for name, records in figures.owners)
    header = [f"# Proposed by `conclave plan {source_path} --propose` from public figures only:",
              f"#   declared records {owners} ({figures.records} in all), {figures.classes} classes,",
              f"#   {figures.width} {'columns' if figures.table else 'values per input'}, a public pool of "
              f"{figures.pool} rows, budget ε {figures.epsilon:g} at δ {figures.delta:g}.",
              f"# Why {proposal.choice}: {proposal.reason}.",
              f"# {proposal.choice}: {proposal.rule}",
              f"# Planned guarantee: ε {proposal.guarantee.epsilon:.4g} ({proposal.guarantee.basis}); the planned "
              f"work's worst case ε {proposal.planned_worst_case:.4g}.",
              *(f"# warning: {warning}" for warning in proposal.warnings)]
    body = yaml.safe_dump(kept, sort_keys=False, allow_unicode=True)
    proposed = yaml.safe_dump(proposal.sections, sort_keys=False, allow_unicode=True)
    return "\n".join(header) + "\n" + body + "# --- proposed ---\n" + proposed


# --- calibration -------------------------------------------------------------------------


def _admitted(pipeline: Pipeline) -> bool:
    """Whether the run's own Rényi filter (if it declares a budget) admits all its planned work."""
    planned = pipeline.plan()
    budget = pipeline.config.privacy.budget_filter(planned)
    if budget is None:
        return True
    return budget.admits(float(planned.rdp[order_index(budget.order, planned.orders)]), planned.extra_delta)


def _fits(build: Callable[[Any], Pipeline], value: Any, epsilon: float) -> bool:
    """Whether ``build(value)`` plans at most ``epsilon`` and its filter admits its planned work (a
    budget too small for any of the filter's orders refuses the config: it does not fit)."""
    try:
        pipeline = build(value)
    except ValueError:
        return False
    return (worst_case_guarantee(pipeline.plan(), pipeline.config.privacy.delta).epsilon <= epsilon
            and _admitted(pipeline))


def smallest_sigma(build: Callable[[float], Pipeline], epsilon: float, high: float, low: float = 1e-2) -> float:
    """The smallest σ in [low, high] (to ``SIGMA_DIGITS`` significant digits, rounded up) whose run
    ``build(σ)`` (a pipeline) plans at most ``epsilon`` and whose filter admits its planned work:
    bisection, ε falling in σ. ``high`` bounds the search (the sampled accountants' work grows with σ)."""
    if not _fits(build, high, epsilon):
        raise ProposalError(f"no noise up to σ {high:.3g} fits the budget ε {epsilon:g}: too little budget for "
                            "this vote source (a larger budget, or another source)")
    while high / low > 1 + 10 ** -(SIGMA_DIGITS + 1):
        middle = math.sqrt(low * high)
        low, high = (low, middle) if _fits(build, middle, epsilon) else (middle, high)
    return _round_up(high)


def _round_up(value: float) -> float:
    scale = 10 ** (math.floor(math.log10(value)) - SIGMA_DIGITS + 1)
    return float(f"{math.ceil(value / scale - 1e-9) * scale:.{SIGMA_DIGITS}g}")  # the decimal shown, exactly


def _base(raw: dict[str, Any], sections: dict[str, Any]) -> Pipeline:
    """The pipeline ``raw`` with ``sections`` runs (through the front door: its plan is what a run charges)."""
    from conclave.cluster.pipelines import load_pipeline

    try:
        return load_pipeline(proposed_config(raw, sections))
    except ValueError as err:  # ConfigError included: a setting the figures cannot make valid
        raise ProposalError(f"the proposal does not fit this config: {err}") from err


def _with_mechanism(pipeline: Pipeline, name: str, params: dict[str, float]) -> Pipeline:
    return pipeline.with_config(dataclasses.replace(pipeline.config, mechanism=MechanismConfig(name, params)))


def _aggregation(figures: PublicFigures) -> dict[str, Any]:
    """Records that vote across owners meet only in the secure sum (the config refuses otherwise)."""
    return {"aggregation": "secure"} if figures.secure else {}


def _student(raw: dict[str, Any], **settings: Any) -> dict[str, Any]:
    return {"student": {**(raw.get("student") or {}), **settings}}


# --- public clusters ---------------------------------------------------------------------


def cluster_sizes(figures: PublicFigures, noise: Callable[[int], float]) -> tuple[int, int, bool]:
    """(clusters, votes per record, whether both conditions hold) for ``figures``, where ``noise(m)``
    is the total's noise deviation at m votes per record (module docstring). Failing both, the pair
    that fails least (the smaller of its two ratios largest)."""
    records = figures.records
    locality = records / figures.classes / LOCALITY
    count = min(figures.pool, figures.max_batch)
    fewest = min(figures.pool, max(2, figures.classes))
    best: tuple[float, int, int] | None = None
    while count >= fewest:
        for m in (m for m in VOTES_PER_RECORD if 2 * m <= count):
            votes = records * m / count
            margin, spread = votes / (VOTE_MARGIN * noise(m)), locality / votes
            if margin >= 1 and spread >= 1:
                return count, m, True
            if best is None or min(margin, spread) > best[0]:
                best = (min(margin, spread), count, m)
        count = min(count - 1, int(count * COUNT_STEP))
    if best is None:  # a pool of fewer than two rows
        raise ProposalError(f"the public pool has {figures.pool} rows: too few to cluster")
    return best[1], best[2], False


def _clusters(raw: dict[str, Any], figures: PublicFigures) -> tuple[dict[str, Any], str, list[str]]:
    embedding, dims = TABLE_EMBEDDING if figures.table else IMAGE_EMBEDDING
    dims = max(1, min(dims, figures.pool, figures.width))
    count = min(figures.pool, figures.max_batch)
    aggregation = _aggregation(figures)

    def section(count: int, m: int) -> dict[str, Any]:
        return {"clusters": {"count": count, "votes_per_record": m, "embedding": embedding, "dims": dims}}

    sigmas: dict[int, float] = {}

    def sigma_for(m: int, count: int = count) -> float:
        if m not in sigmas:  # one release whatever the count: σ depends on m alone
            base = _base(raw, {**section(count, m), "mechanism": {"name": PublicClusterVotes.name, "params": {"sigma": 1.0}},
                               **aggregation})
            sigmas[m] = smallest_sigma(lambda s: _with_mechanism(base, PublicClusterVotes.name, {"sigma": s}),
                                       figures.epsilon, high=CLUSTER_SIGMA_MAX)
        return sigmas[m]

    count, m, fits = cluster_sizes(figures, lambda m: sigma_for(m) * figures.noise_factor)
    sigma = sigma_for(m)
    votes = figures.records * m / count
    sections = {**section(count, m), "mechanism": {"name": PublicClusterVotes.name, "params": {"sigma": sigma}},
                **aggregation, **_student(raw, queries=count, batch_size=count, checkpoints=[]),
                "privacy": {**(raw.get("privacy") or {}), "budget": figures.epsilon}}
    rule = (f"{count} clusters of the {figures.pool}-row pool asked in one batch, each record voting for its {m} "
            f"nearest: a medoid expects {votes:.3g} votes against noise deviation "
            f"{sigma * figures.noise_factor:.3g} (σ {sigma:g}, calibrated to the budget)")
    warnings = [] if fits else [
        f"the declared records are too few for this ε: a medoid expects {votes:.3g} votes, under "
        f"{VOTE_MARGIN:g} noise deviations or over a {LOCALITY:g}th of a class's records; labels will be noisy "
        "(more records, or a larger budget)"]
    return sections, rule, warnings


# --- kNN votes ---------------------------------------------------------------------------


def _largest_queries(build: Callable[[int], Pipeline], epsilon: float, cap: int) -> int:
    """The most queries in [1, cap] whose config fits ``epsilon`` (0 if none): fitting holds up to
    some number and not beyond."""
    if not _fits(build, 1, epsilon):
        return 0
    if _fits(build, cap, epsilon):
        return cap
    good, bad = 1, cap
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _fits(build, middle, epsilon) else (good, middle)
    return good


def _queries_and_sigma(raw: dict[str, Any], figures: PublicFigures, sections: Callable[[int, float], dict[str, Any]],
                       mechanism: Callable[[float], tuple[str, dict[str, float]]], ceiling: float, most: float
                       ) -> tuple[int, float, list[str]]:
    """(queries, σ): the most queries up to the pool at σ = ``ceiling``, then σ lowered to the least
    that still fits them; under ``MIN_QUERIES``, that many at up to σ = ``most`` (noise that swamps
    every vote: past it, no proposal), with a warning."""
    queries = _largest_queries(lambda q: _base(raw, sections(q, ceiling)), figures.epsilon, figures.pool)
    warnings, high = [], ceiling
    if queries < min(MIN_QUERIES, figures.pool):
        queries, high = min(MIN_QUERIES, figures.pool), most
        warnings.append(f"{queries} queries need noise above {ceiling:.3g} at this budget: the answers will be noisy "
                        "(more records, or a larger budget)")
    base = _base(raw, sections(queries, ceiling))
    sigma = smallest_sigma(lambda s: _with_mechanism(base, *mechanism(s)), figures.epsilon, high=high)
    return queries, sigma, warnings


def _knn(raw: dict[str, Any], figures: PublicFigures) -> tuple[dict[str, Any], str, list[str]]:
    records = figures.records
    rate = 0.3 if records <= KNN_FEW_RECORDS else 0.1
    k = int(min(max(round(records * rate / KNN_RECORDS_PER_NEIGHBOUR), KNN_K[0]), KNN_K[1]))
    embedding, dims = TABLE_EMBEDDING if figures.table else KNN_IMAGE_EMBEDDING
    dims = max(1, min(dims, figures.pool, figures.width))
    threshold = round(KNN_THRESHOLD_SHARE * k, 1)
    aggregation = _aggregation(figures)

    def mechanism(sigma: float) -> tuple[str, dict[str, float]]:
        return PrivateKnnMechanism.name, {"sigma1": sigma, "threshold": threshold, "sigma2": sigma}

    def sections(queries: int, sigma: float) -> dict[str, Any]:
        name, params = mechanism(sigma)
        return {"knn": {"k": k, "sample_rate": rate, "embedding": embedding, "dims": dims},
                "mechanism": {"name": name, "params": params}, **aggregation,
                **_student(raw, queries=queries, batch_size=min(BATCH_SIZE, queries),
                           checkpoints=[q for q in (queries // 4, queries // 2) if q > 0]),
                "privacy": {**(raw.get("privacy") or {}), "budget": figures.epsilon}}

    queries, sigma, warnings = _queries_and_sigma(raw, figures, sections, mechanism, KNN_NOISE_SHARE * k, k)
    rule = (f"k {k} of a Poisson sample at rate {rate:g} ({records} declared records), screening at T {threshold:g}; "
            f"{queries} queries at σ {sigma:g}, the most the budget pays for with σ at most {KNN_NOISE_SHARE:g} k")
    return sections(queries, sigma), rule, warnings


# --- teachers ----------------------------------------------------------------------------


def teacher_counts(figures: PublicFigures) -> list[int]:
    """Each owner's teachers: N / ``RECORDS_PER_TEACHER`` within [owners, ``MAX_TEACHERS``], shared by
    declared records (largest remainders), at least one each and never more than its records."""
    owners = figures.owners
    total = min(max(figures.records // RECORDS_PER_TEACHER, len(owners)), MAX_TEACHERS)
    shares = [total * records / figures.records for _, records in owners]
    counts = [max(1, math.floor(share)) for share in shares]
    for index in sorted(range(len(owners)), key=lambda i: counts[i] - shares[i])[:max(0, total - sum(counts))]:
        counts[index] += 1
    return [min(count, records) for count, (_, records) in zip(counts, owners)]


def _teachers(raw: dict[str, Any], figures: PublicFigures) -> tuple[dict[str, Any], str, list[str]]:
    counts = teacher_counts(figures)
    owners = [{**owner, "teachers": count} for owner, count in zip(raw["owners"], counts)]
    total = sum(counts)

    def mechanism(sigma: float) -> tuple[str, dict[str, float]]:
        return GNMax.name, {"sigma": sigma}

    def sections(queries: int, sigma: float) -> dict[str, Any]:
        return {"owners": owners, "mechanism": {"name": GNMax.name, "params": {"sigma": sigma}},
                **_student(raw, queries=queries, batch_size=min(BATCH_SIZE, queries),
                           checkpoints=[q for q in (queries // 4, queries // 2) if q > 0]),
                "privacy": {**(raw.get("privacy") or {}), "budget": figures.epsilon}}

    queries, sigma, warnings = _queries_and_sigma(raw, figures, sections, mechanism, TEACHER_NOISE_SHARE * total,
                                                  total)
    rule = (f"{total} teachers ({', '.join(str(c) for c in counts)} by owner, about "
            f"{figures.records // total} declared records each), GNMax on {queries} queries at σ {sigma:g}, the most "
            "the budget pays for with σ at most a third of the teachers")
    return sections(queries, sigma), rule, warnings


# --- DP-SGD across the owners ------------------------------------------------------------


def model_parameters(model: str, width: int, classes: int) -> int:
    """The trained parameters of table model ``model`` (one of ``TABLE_MODELS``) on ``width``
    columns: a linear classifier over its features (``quadratic``: the columns and their pairwise
    products, ``learning.models.table.quadratic_features``)."""
    features = {"quadratic": width + width * (width + 1) // 2, "logistic_regression": width}[model]
    return classes * (features + 1)


def dpsgd_model(figures: PublicFigures) -> str | None:
    """The richest of ``TABLE_MODELS`` whose parameters the declared records pay for at the budget
    (``DPSGD_RECORDS_PER_PARAMETER``); None when none is paid for."""
    for model in TABLE_MODELS:
        if figures.records * figures.epsilon >= DPSGD_RECORDS_PER_PARAMETER * model_parameters(
                model, figures.width, figures.classes):
            return model
    return None


def screens(figures: PublicFigures) -> bool:
    """Whether DP-SGD on ``figures``' table screens its columns first (``SCREEN_RECORDS``)."""
    logistic = model_parameters(TABLE_MODELS[-1], figures.width, figures.classes)
    return (figures.table and figures.records >= SCREEN_RECORDS
            and figures.records * figures.epsilon >= SCREEN_RECORDS_PER_PARAMETER * logistic)


def _dpsgd(raw: dict[str, Any], figures: PublicFigures) -> tuple[dict[str, Any], str, list[str]]:
    """DP-SGD across the owners (pipeline active_learning, no labels bought): full batch, so the
    secure sum's noise needs no subsampling bound (at q ≤ 0.5 its general bound costs 2–4× the
    noise the Gaussian's tight one does), a convex table model, σ calibrated to the budget (the
    screening steps' included, where a screening run picks the quadratic model's columns)."""
    records, warnings = figures.records, []
    screen = screens(figures)
    model = TABLE_MODELS[0] if screen else dpsgd_model(figures)
    if model is None:
        model = TABLE_MODELS[-1]
        warnings.append(f"the declared records are too few for this ε: {records} × ε {figures.epsilon:g} is under "
                        f"{DPSGD_RECORDS_PER_PARAMETER:g} per parameter of {model}; the model will be noisy (more "
                        "records, or a larger budget)")
    parameters = model_parameters(model, figures.width, figures.classes)
    steps = int(min(max(round(DPSGD_STEPS_PER_EPSILON * figures.epsilon), DPSGD_STEPS[0]), DPSGD_STEPS[1]))
    screening = {"screen_steps": SCREEN_STEPS, "screen_keep": SCREEN_KEEP} if screen else {}

    def sections(sigma: float) -> dict[str, Any]:
        return {"model": model,
                "dpsgd": {"epochs": steps, "batch_size": records, "lr": DPSGD_LR, "momentum": DPSGD_MOMENTUM,
                          "max_grad_norm": DPSGD_CLIP, "lr_schedule": "cosine", "noise_multiplier": sigma,
                          **screening},
                "selection": {"strategies": []},
                "privacy": {**(raw.get("privacy") or {}), "budget": figures.epsilon}}

    sigma = smallest_sigma(lambda s: _base(raw, sections(s)), figures.epsilon, high=CLUSTER_SIGMA_MAX)
    across = f"across the {len(figures.owners)} owners through the secure sum" if len(figures.owners) > 1 else \
        "on the owner's records"
    first = (f"first a screening run of {SCREEN_STEPS} steps of logistic regression at the same noise keeps the "
             f"columns whose weights' norm is at least {SCREEN_KEEP:g} of the largest (at least {SCREEN_RECORDS} "
             f"declared records paying {SCREEN_RECORDS_PER_PARAMETER:g} × ε per logistic parameter: it gained 4–10 "
             "points on the consortium proxies), then " if screen else "")
    rule = (f"DP-SGD {across}, {first}model {model} ({parameters} parameters: {records} declared records × ε "
            f"{figures.epsilon:g} = {records * figures.epsilon / parameters:.3g} per parameter"
            f"{', those of dropped columns left out of every prediction' if screen else ''}), every declared "
            f"record in each of {steps} steps (q = 1), lr {DPSGD_LR:g} with momentum {DPSGD_MOMENTUM:g} "
            f"decaying to 0, clip {DPSGD_CLIP:g}, noise multiplier {sigma:g} (calibrated to the budget"
            f"{', both runs together' if screen else ''}); no labels bought: the DP model is the result")
    return sections(sigma), rule, warnings
