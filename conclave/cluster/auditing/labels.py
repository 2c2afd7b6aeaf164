"""The one-run audit of the ``teacher_student`` pipeline's label aggregator (Steinke, Nasr &
Jagielski, NeurIPS 2023): canary records in the teachers' data, their queries asked of the real
aggregator, the released labels as membership guesses, and the lower bound on ε.

A canary moves one teacher's vote, so ``choose_design`` builds base data that puts every canary
query at the mechanism's decision boundary; the audit is a run of its own, charged to a temporary
run ledger. Its canaries go into the teachers' data, so it audits a config of the benchmark
(``data``): owners' records stay behind their gateways. The argument: docs/privacy.md, "The
one-run audit".
``AuditSettings.broken_noise`` (tests only) scales the mechanism's noise while the charge keeps σ.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conclave.cluster.auditing import AuditResult, AuditSettings, SecretInclusion
from conclave.cluster.owners import PublicData
from conclave.cluster.run_privacy import RunPrivacy
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.errors import InvalidValue
from conclave.learning.data import Dataset, shard
from conclave.learning.data.dataset import record_hashes
from conclave.learning.data.schema import InputSchema, Standardiser
from conclave.privacy.accounting.audit import epsilon_lower_bound
from conclave.privacy.accounting.filter import order_index
from conclave.privacy.mechanisms import ABSTAIN, MechanismResult, SecureVoteMechanism, VoteMechanism
from conclave.privacy.noise import SECURE, NoisePolicy

log = logging.getLogger(__name__)

PIPELINE = "teacher_student"
OUT_CLASS, CANARY_CLASS, THIRD_CLASS = 0, 1, 2
# A host's pin differs from its canary in this share of the entries: near enough that the host
# votes 0 on the canary query while the canary is out, far enough that it learns the canary when
# it is in (digits, 60 epochs, 5 teachers: at 1/32 included canaries were missed, at 1/8 learnt
# ones spilled over onto the host's other canary queries; at 1/16, 0 errors in 600 queries).
HOST_PIN_SHARE = 1 / 16
DESIGN_DRAWS = 2000  # simulated answers per histogram when ranking designs (advantages to about ±0.02)
METHOD = ("teacher_student labels, one run: {m} canaries (random out-of-distribution inputs, class 1) each "
          "added with probability 1/2 to a host teacher's data; every teacher holds a near copy of each "
          "canary input labelled with its vote ({canary} teachers vote 1, {third} vote 2, {hosts} hosts "
          "vote 0), so one host's vote decides the mechanism's answer without noise; guess = in where the "
          "released label of the canary's query is 1")


class ScaledDraws:
    """A generator whose normal and Laplace draws have their scale multiplied by ``factor``. Any
    other draw is refused: a mechanism drawing otherwise must not pass for broken."""

    def __init__(self, rng: np.random.Generator, factor: float) -> None:
        self._rng = rng
        self._factor = factor

    def normal(self, loc: Any = 0.0, scale: Any = 1.0, size: Any = None) -> Any:
        return self._rng.normal(loc, np.multiply(scale, self._factor), size)

    def laplace(self, loc: Any = 0.0, scale: Any = 1.0, size: Any = None) -> Any:
        return self._rng.laplace(loc, np.multiply(scale, self._factor), size)


@dataclass(frozen=True)
class ScaledNoise:
    """``mechanism`` drawing its noise at ``factor`` times its σs while it charges (and describes
    itself with) the configured ones: the deliberately broken build (tests only)."""

    mechanism: VoteMechanism
    factor: float

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        return self.mechanism(votes, ScaledDraws(rng, self.factor))

    def __getattr__(self, name: str) -> Any:  # name, stateless, worst_case_charge...: the configured mechanism's
        if name.startswith("__") or name == "mechanism":
            raise AttributeError(name)
        return getattr(self.mechanism, name)


@dataclass(frozen=True)
class Design:
    """How the teachers vote on every canary query: the first ``canary_voters`` vote the canary
    class, the next ``third_voters`` the third class, the rest (the hosts) the out class — a
    host holding its canary votes the canary class instead. ``advantage``: P(released 1 | in) −
    P(released 1 | out) with the configured noise, simulated."""

    teachers: int
    canary_voters: int
    third_voters: int
    advantage: float

    @property
    def hosts(self) -> int:
        return self.teachers - self.canary_voters - self.third_voters

    def vote(self, teacher: int) -> int:
        """The class ``teacher`` votes on a canary query it does not hold (its pins' label)."""
        if teacher < self.canary_voters:
            return CANARY_CLASS
        return THIRD_CLASS if teacher < self.canary_voters + self.third_voters else OUT_CLASS

    def is_host(self, teacher: int) -> bool:
        return self.vote(teacher) == OUT_CLASS


def _histograms(teachers: int, canary: int, third: int, classes: int) -> np.ndarray:
    """int64 [2, classes]: the votes on a canary query with its canary out, then in."""
    votes = np.zeros((2, classes), dtype=np.int64)
    hosts = teachers - canary - third
    votes[:, CANARY_CLASS] = canary, canary + 1
    votes[:, OUT_CLASS] = hosts, hosts - 1
    if third:
        votes[:, THIRD_CLASS] = third
    return votes


def _advantage(mechanism, teachers: int, canary: int, third: int, classes: int, draws: int) -> float:
    """P(released canary class | in) − P(… | out), simulated. The simulation is the auditor's
    planning, not a release: a fixed seed keeps the ranking repeatable and compares every split,
    and both histograms, on the same draws."""
    rates = []
    for votes in _histograms(teachers, canary, third, classes):
        labels = mechanism(np.repeat(votes[None], draws, axis=0), np.random.default_rng(0)).labels
        rates.append(float(np.mean(labels == CANARY_CLASS)))
    return rates[1] - rates[0]


def choose_design(mechanism: VoteMechanism, teachers: int, classes: int, draws: int = DESIGN_DRAWS) -> Design:
    """The split of ``teachers`` whose canary queries the noise-free mechanism answers with the
    canary class exactly when the canary is in, and of those the one that the configured noise
    and a tenth of it (a partly broken build) hide least, summed; all splits are ranked so when
    none separates. Public parameters only."""
    if classes < 2:
        raise InvalidValue(f"the label audit needs at least 2 classes, the data has {classes}")
    splits = [(canary, third) for third in range(min(1, classes - 2) + 1) for canary in range(teachers - third)]
    quiet, rng = ScaledNoise(mechanism, 0.0), np.random.default_rng(0)
    separating = [(canary, third) for canary, third in splits
                  if tuple(quiet(_histograms(teachers, canary, third, classes), rng).labels == CANARY_CLASS)
                  == (False, True)]
    tenth = ScaledNoise(mechanism, 0.1)
    ranked = max(separating or splits, key=lambda split: sum(
        _advantage(noisy, teachers, *split, classes, draws) for noisy in (mechanism, tenth)))
    design = Design(teachers, *ranked, _advantage(mechanism, teachers, *ranked, classes, draws))
    log.info("label audit design: %d of %d teachers vote the canary class, %d a third class, %d hosts; "
             "simulated advantage %.3f%s", design.canary_voters, teachers, design.third_voters, design.hosts,
             design.advantage, "" if separating else " (no split separates in from out without noise)")
    return design


@dataclass(frozen=True)
class Patterns:
    """Out-of-distribution inputs of ``schema``'s shape: binary images at its value range, or
    table rows at ±3 public standard deviations per column; and their near copies."""

    schema: InputSchema
    standardiser: Standardiser | None

    @property
    def size(self) -> int:
        return math.prod(self.schema.shape)

    def draw(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """float32 [count, *shape]: fresh random inputs."""
        signs = rng.integers(0, 2, size=(count, self.size))
        if self.schema.low is not None:
            flat = np.where(signs == 1, self.schema.high, self.schema.low)
        else:
            mean, scale = self._statistics()
            flat = mean + scale * np.where(signs == 1, 3.0, -3.0)
        return flat.reshape(count, *self.schema.shape).astype(np.float32)

    def near(self, pattern: np.ndarray, first: int, count: int) -> np.ndarray:
        """Copies ``first``..``first + count - 1`` of ``pattern``, each one entry moved by a
        tiny step (inward for images), all distinct: the same input to a model, another record."""
        index = np.arange(first, first + count)
        rows, entry, step = np.arange(count), index % self.size, index // self.size + 1
        copies = np.repeat(pattern.reshape(1, -1), count, axis=0).astype(np.float64)
        if self.schema.low is not None:
            span = self.schema.high - self.schema.low
            inward = np.where(copies[rows, entry] > self.schema.low + span / 2, -1.0, 1.0)
            copies[rows, entry] += inward * step * span * 2.0 ** -12
        else:
            copies[rows, entry] += step * self._statistics()[1][entry] * 1e-3
        return copies.reshape(count, *self.schema.shape).astype(np.float32)

    def flipped(self, pattern: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` copies of ``pattern``, each with its own ``HOST_PIN_SHARE`` of the entries
        flipped (an image's to the other end of the range, a row's to the other side of the mean)."""
        flips = max(1, round(self.size * HOST_PIN_SHARE))
        copies = np.repeat(pattern.reshape(1, -1), count, axis=0).astype(np.float64)
        entries = np.argsort(rng.random((count, self.size)), axis=1)[:, :flips]
        rows = np.arange(count)[:, None]
        if self.schema.low is not None:
            copies[rows, entries] = self.schema.low + self.schema.high - copies[rows, entries]
        else:
            mean = self._statistics()[0]
            copies[rows, entries] = 2 * mean[entries] - copies[rows, entries]
        return copies.reshape(count, *self.schema.shape).astype(np.float32)

    def _statistics(self) -> tuple[np.ndarray, np.ndarray]:
        if self.standardiser is not None:
            return self.standardiser.mean.astype(np.float64), self.standardiser.scale.astype(np.float64)
        return np.zeros(self.size), np.ones(self.size)


@dataclass(frozen=True)
class Share:
    """Where one owner's teachers sit: its hash (``modulus`` shards keyed with ``seed``), the
    ``used`` first of them as teachers ``offset``.. of the ensemble."""

    modulus: int
    seed: int
    used: int
    offset: int

    def teachers(self, x: np.ndarray, label: int, classes: int) -> np.ndarray:
        """The ensemble's teacher each record (x[i], label) lands with (−1: a shard not used)."""
        records = Dataset(x, np.full(len(x), label, dtype=np.int64), classes, "audit")
        local = (record_hashes(records, self.seed) % np.uint64(self.modulus)).astype(np.int64)
        return np.where(local < self.used, self.offset + local, -1)


def layout(config: TeacherStudentConfig) -> list[Share]:
    """The teachers' shares as ``cluster.teaching.ensemble.teacher_pool`` cuts them: the benchmark's
    ``teachers.count``, keyed with the run's seed."""
    return [Share(config.teachers.count, config.seed, config.teachers.count, 0)]


@dataclass(frozen=True)
class PlacedCanaries:
    """The canary inputs (the queries too) and the ensemble's teacher (a host) each lands with."""

    x: np.ndarray
    host: np.ndarray
    share: np.ndarray  # the owner (index into the shares) whose data each is added to


def place_canaries(count: int, design: Design, shares: Sequence[Share], patterns: Patterns, classes: int,
                   rng: np.random.Generator) -> PlacedCanaries:
    """``count`` fresh inputs whose record (input, canary class) lands in a host, the hosts
    filled evenly (at most ⌈count / hosts⌉ each), in the first owner's data where it does."""
    capacity = math.ceil(count / design.hosts)
    held = np.zeros(design.teachers, dtype=np.int64)
    xs, hosts, owners = [], [], []
    while len(hosts) < count:
        batch = patterns.draw(4 * design.teachers, rng)
        landing = np.stack([share.teachers(batch, CANARY_CLASS, classes) for share in shares])
        for i in range(len(batch)):
            for j, teacher in enumerate(landing[:, i]):
                if teacher >= 0 and design.is_host(teacher) and held[teacher] < capacity and len(hosts) < count:
                    held[teacher] += 1
                    xs.append(batch[i])
                    hosts.append(teacher)
                    owners.append(j)
                    break
    return PlacedCanaries(np.stack(xs), np.array(hosts), np.array(owners))


def audit_records(canaries: PlacedCanaries, inclusion: SecretInclusion, design: Design, shares: Sequence[Share],
                  patterns: Patterns, classes: int, rng: np.random.Generator) -> list[Dataset]:
    """Per owner, the records the audit adds: the pins — for every canary, one record in each
    teacher, a near copy labelled with its vote, or for the canary's host a flipped copy
    labelled the out class — and the canaries drawn in."""
    xs: list[list[np.ndarray]] = [[] for _ in shares]
    ys: list[list[int]] = [[] for _ in shares]
    for i, (pattern, host) in enumerate(zip(canaries.x, canaries.host)):
        tried = 0
        for j, share in enumerate(shares):
            for label in (OUT_CLASS, CANARY_CLASS, THIRD_CLASS):
                wanted = {t for t in range(share.offset, share.offset + share.used)
                          if design.vote(t) == label and t != host}
                while wanted:
                    batch = patterns.near(pattern, tried, 2 * share.used)
                    tried += len(batch)
                    for x, teacher in zip(batch, share.teachers(batch, label, classes)):
                        if teacher in wanted:
                            wanted.discard(teacher)
                            xs[j].append(x)
                            ys[j].append(label)
        j = int(canaries.share[i])
        while True:  # the host's own pin: flipped copies until one lands with it
            batch = patterns.flipped(pattern, 2 * shares[j].used, rng)
            landed = np.flatnonzero(shares[j].teachers(batch, OUT_CLASS, classes) == host)
            if landed.size:
                xs[j].append(batch[landed[0]])
                ys[j].append(OUT_CLASS)
                break
    records = []
    for j, share in enumerate(shares):
        members = inclusion.members(np.flatnonzero(canaries.share == j))
        x = np.concatenate([np.reshape(xs[j], (-1, *patterns.schema.shape)), canaries.x[members]])
        y = np.concatenate([ys[j], np.full(len(members), CANARY_CLASS)]).astype(np.int64)
        records.append(Dataset(x.astype(np.float32), y, classes, f"audit{j}"))
    return records


@dataclass(frozen=True)
class AuditSource:
    """A teacher source with the audit's records added, each to the shard its keyed hash picks
    (``learning.data.shard``, as for any record), after the source's own cut."""

    inner: Any  # actors.teacher.TeacherSource (picklable)
    records: Dataset = field(repr=False)

    @property
    def owner(self) -> str:
        return self.inner.owner

    @property
    def num_teachers(self) -> int:
        return self.inner.num_teachers

    @property
    def features(self) -> str | None:
        return self.inner.features

    def load(self, teacher_ids: Sequence[int]) -> list[Dataset]:
        own = self.inner.load(teacher_ids)
        added = shard(self.records, self.inner.num_teachers, self.inner.seed)
        return [Dataset(np.concatenate([part.x, added[i].x.astype(part.x.dtype)]),
                        np.concatenate([part.y, added[i].y]), part.num_classes, f"{part.name}+audit", part.features)
                for part, i in zip(own, teacher_ids)]


def guesses_from(released: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """+1 (in) where the released label is the canary class, −1 (out) elsewhere; with ``count``
    below the canaries, that many at random, split between in and out as the labels are."""
    scores = np.where(released == CANARY_CLASS, 1, -1)
    if count >= len(scores):
        return scores
    inside = np.flatnonzero(scores == 1)
    keep_in = round(count * len(inside) / len(scores))
    chosen = np.concatenate([rng.permutation(inside)[:keep_in],
                             rng.permutation(np.flatnonzero(scores == -1))[:count - keep_in]])
    guesses = np.zeros(len(scores), dtype=np.int64)
    guesses[chosen] = scores[chosen]
    return guesses


def with_queries(config: TeacherStudentConfig, queries: int) -> TeacherStudentConfig:
    """``config`` as the run "<name>-audit", planning ``queries`` queries (the audit's)."""
    return dataclasses.replace(config, name=f"{config.name}-audit",
                               student=dataclasses.replace(config.student, queries=queries))


def affordable(config: TeacherStudentConfig, wanted: int) -> int:
    """The most canary queries, up to ``wanted``, whose worst case (every one answered) the
    budget pays for: a function of public settings only."""
    if config.privacy.budget is None:
        return wanted

    def pays(queries: int) -> bool:
        try:
            planned = with_queries(config, queries).planned()
        except ValueError:  # the budget holds no order for this plan
            return False
        budget = config.privacy.budget_filter(planned)
        return budget.admits(float(planned.rdp[order_index(budget.order, planned.orders)]), planned.extra_delta)

    paid, unpaid = 0, wanted + 1
    while unpaid - paid > 1:
        middle = (paid + unpaid) // 2
        paid, unpaid = (middle, unpaid) if pays(middle) else (paid, middle)
    return paid


def audit(config: TeacherStudentConfig, settings: AuditSettings) -> AuditResult:
    """The one-run audit of ``config``'s label aggregator (module docstring)."""
    from conclave.cluster.config import ConfigError
    from conclave.cluster.ray_runtime import start_ray
    from conclave.cluster.teaching.ensemble import checked_public, resolved

    if config.owners:
        raise ConfigError("audit: it plants canaries in the teachers' records, which owners keep behind their "
                          "gateways: audit a config of the benchmark (its data section)")
    if settings.canaries < 1 or (settings.guesses is not None and not 1 <= settings.guesses <= settings.canaries):
        raise InvalidValue(f"an audit needs canaries >= 1 and 1 <= guesses <= canaries, got {settings.canaries} "
                         f"and {settings.guesses}")
    if settings.broken_noise is not None and config.secure:
        raise InvalidValue("broken_noise scales the aggregator's noise; with aggregation: secure the teachers draw it")
    public = checked_public(config)
    config = resolved(config, public)
    pool_size = len(public.splits.public)
    m = affordable(config, min(settings.canaries, pool_size))
    if m < 1:
        raise InvalidValue("privacy.budget pays for no query in the worst case: nothing to audit")
    if m < settings.canaries:
        log.warning("label audit: %d canaries, not %d: no more fit the budget's worst case and the public pool "
                    "(%d inputs)", m, settings.canaries, pool_size)
    r = m if settings.guesses is None else min(settings.guesses, m)
    audited = with_queries(config, m)
    policy = audited.privacy.noise
    if settings.broken_noise is not None:
        policy = dataclasses.replace(policy, noise_scale=settings.broken_noise)
    unsound = (policy.unsound_reason,) if policy.unsound_reason else ()

    # The records, from public settings and OS entropy; the inclusion draw stays in ``inclusion``.
    classes = len(public.classes)
    design = choose_design(config.mechanism.instance, config.num_teachers, classes)
    patterns, shares = Patterns(public.schema, public.standardiser), layout(audited)
    rng = SECURE.source("audit-canaries").rng
    canaries = place_canaries(m, design, shares, patterns, classes, rng)
    inclusion = SecretInclusion(m)
    records = audit_records(canaries, inclusion, design, shares, patterns, classes, rng)

    start_ray(None, runtime_env=audited.runtime_env, models=audited.models)
    mechanism = audited.answering_mechanism()  # it answers the canaries: its own copy
    if settings.broken_noise is not None:
        mechanism = ScaledNoise(mechanism, settings.broken_noise)
    released, report = ask_canaries(audited, public, shares, records, mechanism, policy, canaries.x)

    # Guesses from the released labels alone; the inclusion draw is read only after.
    guesses = guesses_from(released, r, SECURE.source("audit-guesses").rng)
    correct = inclusion.correct(guesses)
    guarantee = report.guarantee.marked(unsound)
    bound = epsilon_lower_bound(m, r, correct, guarantee.delta, settings.confidence)
    method = METHOD.format(m=m, canary=design.canary_voters, third=design.third_voters, hosts=design.hosts)
    return AuditResult(PIPELINE, audited.name, bound, guarantee, m, r, correct, method, unsound)


def ask_canaries(config: TeacherStudentConfig, public: PublicData, shares: Sequence[Share],
                 records: Sequence[Dataset], mechanism: VoteMechanism | SecureVoteMechanism | ScaledNoise,
                 policy: NoisePolicy, queries: np.ndarray) -> tuple[np.ndarray, RunPrivacy]:
    """Train the teachers on the benchmark's data plus ``records``, serve them through the real
    aggregator with ``mechanism`` and the noise ``policy``, ask ``queries`` over gRPC as any client
    would; returns (the released labels, the run's privacy report)."""
    from conclave.actors.aggregator import AggregatorServer, ServerSettings
    from conclave.actors.teacher import OwnerShare
    from conclave.cluster.client import AggregatorClient
    from conclave.cluster.teaching.aggregation import Aggregator, reserve_estimates
    from conclave.cluster.teaching.ensemble import teacher_pool

    def with_records(owner_shares: list[OwnerShare]) -> list[OwnerShare]:
        cut = [(share.source.num_teachers, share.source.seed, share.num_teachers) for share in owner_shares]
        if cut != [(share.modulus, share.seed, share.used) for share in shares]:
            raise RuntimeError("the teachers' shards are not cut as the audit placed its records")
        return [OwnerShare(AuditSource(share.source, added), share.num_teachers, share.num_actors)
                for share, added in zip(owner_shares, records)]

    pool = teacher_pool(config, public, with_records=with_records)
    try:
        pool.train(progress=False)
        with tempfile.TemporaryDirectory(prefix="conclave-audit-") as folder:
            planned = config.planned()
            ledger = config.privacy.open_ledger(Path(folder) / "ledger.sqlite", planned)
            try:
                reserve_estimates(config, ledger)
                token = secrets.token_urlsafe(24)
                server = AggregatorServer(pool, mechanism, ledger, pool.input_shape,
                                          ServerSettings(token=token, max_batch=config.server.max_batch), noise=policy)
                aggregator = Aggregator(config, server, ledger, server.start(), token)
            except BaseException:
                ledger.close()
                raise
            with aggregator:
                batch = config.student.batch_size
                with AggregatorClient(aggregator.address, token, retry_unavailable=60.0) as client:
                    released = np.concatenate([client.label(queries[start:start + batch])
                                               for start in range(0, len(queries), batch)])
                aggregator.stop()
                report = aggregator.privacy_report()
    finally:
        pool.shutdown()
    log.info("label audit: %d canary queries, %d answered with the canary class, %d abstained", len(released),
             int((released == CANARY_CLASS).sum()), int((released == ABSTAIN).sum()))
    return released, report
