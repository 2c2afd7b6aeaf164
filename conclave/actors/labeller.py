"""The aggregator's core: teacher votes in, private labels out, every release paid for first.

``PrivateLabeller.label`` answers inputs on record as first released (free, identical), asks the
vote source for the rest, runs the mechanism, charges the ledger with the answers in the same
transaction, and only then commits the mechanism's state and releases. A refused charge changes
nothing; a batch the budget pays for in part is answered up to its affordable prefix (worst cases
depend on the count alone, so finding it reveals nothing).
``SecureLabeller`` does the same over secure rounds, each charged when its shares are asked for.
No gRPC here: ``actors.aggregator`` serves this.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from conclave.actors.group_commit import GroupCommit
from conclave.actors.owners import OwnerDropout
from conclave.errors import ConclaveError, InvalidValue
from conclave.learning.data.schema import InputSchema
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import Guarantee, unbounded_guarantee
from conclave.privacy.accounting.ledger import AnsweringLedger, BudgetExceeded
from conclave.privacy.mechanisms.base import ABSTAIN, SecureVoteMechanism, VoteMechanism
from conclave.privacy.noise import SECURE, NoisePolicy
from conclave.privacy.secure_votes import SkellamVotes, VoteBound

log = logging.getLogger(__name__)

INPUT_DTYPE = np.dtype("<f4")  # the one dtype the wire format accepts ("float32")
WIRE_DTYPE = "float32"
# Most new inputs of concurrent calls answered together (one call alone may be larger): the
# teachers' vote call and the ledger transaction stay bounded.
GROUP_LIMIT = 1024


class VoteSource(Protocol):
    """What the aggregator needs from the voters (``actors.teacher.TeacherPool``,
    ``actors.knn_votes.KnnVoteSource``, or a user's own).

    ``ready`` is required: the aggregator's health follows it, and after a failed vote it is
    the only way back to SERVING (a source without it would stay NOT_SERVING for good).
    """

    neighbouring: Neighbouring  # the record-level relation under which one record moves at most one vote
    neighbouring_lemma: str  # why
    # Every histogram row counts exactly this many votes (teachers: one each), so a row short of
    # it is a partial ensemble, never answered; None where the count varies (kNN's sampled
    # neighbours; public clusters, whose records vote for m queries of the batch: a batch total).
    votes_per_query: int | None
    # Whether a query's votes depend on the batch's other queries (public clusters): then each
    # call is its own release, never merged with another client's (``PrivateLabeller.label``).
    batch_coupled: bool
    num_classes: int  # the columns of its histograms
    # Whether its votes meet only in secure rounds (owner-local kNN): False for every other source.
    local: bool
    # The settings a mechanism may be charged for (``check_pairing``), None where the votes have
    # none: each record's inclusion probability per query (kNN) and the queries it votes for
    # (public clusters).
    sample_rate: float | None
    votes_per_record: int | None

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """int [batch, num_classes] vote histogram for float32 inputs [batch, *input_shape]."""
        ...

    def ready(self, timeout: float = 2.0) -> bool:
        """Whether every voter can vote now (within ``timeout`` s); brings back what it can."""
        ...


class SecureVoteSource(Protocol):
    """What the aggregator needs from the teachers with ``aggregation: secure``
    (``actors.teacher.TeacherPool``): rounds of noised totals, never a clean histogram."""

    neighbouring: Neighbouring
    neighbouring_lemma: str
    batch_coupled: bool  # as ``VoteSource.batch_coupled``
    num_classes: int
    local: bool  # as ``VoteSource.local``
    sample_rate: float | None  # as ``VoteSource.sample_rate``
    votes_per_record: int | None  # as ``VoteSource.votes_per_record``

    def ready(self, timeout: float = 2.0) -> bool:
        """Whether every owner's actors can take part in a round now (within ``timeout`` s)."""
        ...

    def noised_votes(self, inputs: np.ndarray, release: SkellamVotes, noise: NoisePolicy,
                     charge: Callable[[], None]) -> np.ndarray:
        """int64 [batch, num_classes]: the histograms of float32 ``inputs`` summed through the secure
        sum with Skellam noise (``release``); ``OwnerDropout`` naming the owner when a share is missing.
        Calls ``charge`` once, before the first share is asked for (the moment the round becomes a
        release to whoever holds this process), and asks nothing if it raises."""
        ...


def check_pairing(vote_source: VoteSource | SecureVoteSource,
                  mechanism: VoteMechanism | SecureVoteMechanism) -> None:
    """Refuse a mechanism charged for another vote source than this one: each attribute it is paired
    with (``paired_with``: a kNN sample rate, the votes per record of public clusters) must be the
    vote source's, or its record-level charge would understate ε; and a source whose votes meet
    only in secure rounds (owner-local kNN) takes only a secure mechanism."""
    for attribute in mechanism.paired_with:  # a source without the setting (None: teachers) is a mismatch too
        wanted, held = getattr(mechanism, attribute), getattr(vote_source, attribute)
        if held != wanted:
            raise InvalidValue(f"mechanism {mechanism.name} is charged for votes with {attribute} {wanted:g}; this vote "
                             f"source has {attribute} {held if held is not None else 'unset'}: pair it with a vote "
                             "source of that setting")
    if vote_source.local and not isinstance(mechanism, SecureVoteMechanism):
        raise InvalidValue(f"owner-local votes meet only in secure rounds; mechanism {mechanism.name} needs clean "
                         "histograms: use aggregation: secure")


class InvalidInput(ConclaveError, ValueError):
    """A request the aggregator cannot label; the message names the problem (bounded length)."""


class TeachersUnavailable(ConclaveError, RuntimeError):
    """The vote source is not ready or failed to vote."""


class RateLimitedLog:
    """Log lines of per-request failures, at most one per ``interval`` seconds per kind, each
    with the count of those left out; only the first line of a kind carries its traceback.
    (On a full disk every call fails: a traceback each made 12,625 lines for 407 calls.)"""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()  # called from the label threads and the event loop
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, kind: str, message: str, *args: Any, level: int = logging.INFO,
                 exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            first = kind not in self._last
            if not first and now - self._last[kind] < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            skipped = self._suppressed.pop(kind, 0)
            self._last[kind] = now
        suffix = f" (and {skipped} more since the last line)" if skipped else ""
        self._logger.log(level, message + suffix, *args, exc_info=exc_info if first else None)


def _clip(text: str, limit: int = 40) -> str:
    """A client's string as it may appear in an error message: short, printable."""
    text = text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def decode_inputs(shape: tuple[int, ...], dtype: str, data: bytes, schema: InputSchema,
                  max_batch: int) -> np.ndarray:
    """The float32 array [batch, *schema.shape] a request tensor carries, or ``InvalidInput``."""
    input_shape = schema.shape
    shape = tuple(int(d) for d in shape)
    expected = "[batch, " + ", ".join(str(d) for d in input_shape) + "]"
    if len(shape) != 1 + len(input_shape) or shape[1:] != tuple(input_shape):
        shown = list(shape[:8]) + (["..."] if len(shape) > 8 else [])
        raise InvalidInput(f"wrong shape {shown}: inputs must have shape {expected}")
    batch = shape[0]
    if batch <= 0:
        raise InvalidInput(f"empty batch (shape {list(shape)}): send at least one input")
    if batch > max_batch:
        raise InvalidInput(f"batch of {batch} inputs is over this server's maximum of {max_batch}")
    if dtype != WIRE_DTYPE:
        raise InvalidInput(f"dtype {_clip(dtype)!r} is not supported: send 'float32' (little-endian)")
    expected_bytes = math.prod(shape) * INPUT_DTYPE.itemsize
    if len(data) != expected_bytes:
        raise InvalidInput(f"data has {len(data)} bytes, but shape {list(shape)} of float32 needs {expected_bytes}")
    inputs = np.frombuffer(data, dtype=INPUT_DTYPE).reshape(shape)
    finite = np.isfinite(inputs.reshape(batch, -1)).all(axis=1)
    if not finite.all():
        raise InvalidInput(f"inputs contain NaN or infinity (examples {_first(~finite)})")
    # Where the schema has a range (images: [0, 1], learning.data.Dataset), a value outside it
    # is a client bug (e.g. raw 0–255 bytes) that would buy labels for meaningless inputs.
    if schema.low is not None:
        in_range = ((inputs >= schema.low) & (inputs <= schema.high)).reshape(batch, -1).all(axis=1)
        if not in_range.all():
            what = "pixel values" if schema.kind == "image" else "values"
            raise InvalidInput(f"{what} must be in [{schema.low:g}, {schema.high:g}] (examples {_first(~in_range)} "
                               f"hold values in [{inputs.min():g}, {inputs.max():g}])")
    return inputs.astype(np.float32)  # native byte order, writable copy


def _first(mask: np.ndarray, count: int = 5) -> str:
    bad = np.flatnonzero(mask)
    return str(bad[:count].tolist())[:-1] + (", ...]" if bad.size > count else "]")


def input_keys(inputs: np.ndarray) -> list[bytes]:
    """Answer key of each example: sha256 of its float32 bytes, made canonical first — -0.0 as
    +0.0 and every NaN as one NaN — so that one input cannot be asked twice under two spellings
    and get fresh noise the second time. (The wire rejects NaN; an in-process caller may not.)
    Every other value keeps its bytes, so the keys of answers on record do not change."""
    flat = np.asarray(inputs, dtype=np.float32).reshape(len(inputs), -1) + np.float32(0.0)  # -0 + 0 = +0
    flat[np.isnan(flat)] = np.float32(np.nan)
    flat = np.ascontiguousarray(flat, dtype=INPUT_DTYPE)
    return [hashlib.sha256(row.tobytes()).digest() for row in flat]


@dataclass(frozen=True)
class LabelOutcome:
    """What one batch got: a label per input (``ABSTAIN`` = -1 where the mechanism declined
    or the budget refused), and which inputs the budget refused (new inputs beyond what the
    remaining budget pays)."""

    labels: np.ndarray  # int64 [batch]
    refused: np.ndarray  # bool [batch]

    @property
    def answered(self) -> int:
        return int((self.labels != ABSTAIN).sum())


@dataclass(frozen=True)
class BudgetStatus:
    """The budget reply: what was spent, what may be published, and the query counters."""

    epsilon_spent: float  # realised spend (an odometer reading, not a guarantee)
    delta: float
    epsilon_limit: float  # the declared budget's ε; inf without one
    mechanism: str
    guarantee: Guarantee  # what may be published
    queries_answered: int  # distinct inputs answered with a label
    queries_abstained: int  # distinct inputs the mechanism declined to label
    cache_hits: int  # repeated inputs answered from the record at no cost
    affordable_queries: int  # new inputs the budget pays for now in the worst case (``Pricing.affordable``)

    @property
    def sound(self) -> bool:
        return self.guarantee.sound

    def as_dict(self) -> dict[str, Any]:
        """The reply's fields as the client library returns them (``guarantee`` nested)."""
        guarantee = self.guarantee
        return {
            "epsilon_spent": float(self.epsilon_spent), "delta": float(self.delta),
            "epsilon_limit": float(self.epsilon_limit), "mechanism": self.mechanism, "sound": self.sound,
            "queries_answered": self.queries_answered, "queries_abstained": self.queries_abstained,
            "cache_hits": self.cache_hits, "affordable_queries": self.affordable_queries,
            "guarantee": {"epsilon": float(guarantee.epsilon), "delta": float(guarantee.delta),
                          "basis": guarantee.basis, "neighbouring": guarantee.neighbouring.value,
                          "theorem": guarantee.theorem, "order": guarantee.order or 0.0,
                          "unsound_reasons": list(guarantee.unsound_reasons)},
        }


@dataclass(frozen=True)
class _Asked:
    """One call's inputs and its new ones (key → first row), waiting to be answered with others."""

    inputs: np.ndarray
    fresh: dict[bytes, int]


@dataclass
class _Counters:
    """The counts the budget reply publishes, and the histograms the run's privacy report analyses."""

    answered: int = 0
    abstained: int = 0
    cache_hits: int = 0
    votes: list[np.ndarray] = field(default_factory=list)  # histograms the mechanism answered, in order
    labels: list[np.ndarray] = field(default_factory=list)  # what it released for them (ABSTAIN included)

    @classmethod
    def on_record(cls, answers: dict[bytes, int]) -> _Counters:
        """Counters of distinct inputs that survive a restart: counted from the answers on record."""
        labels = np.fromiter(answers.values(), dtype=np.int64, count=len(answers))
        abstained = int((labels == ABSTAIN).sum())
        return cls(answered=len(labels) - abstained, abstained=abstained)

    def count(self, labels: np.ndarray) -> None:
        """Count a batch's released labels (ABSTAIN included)."""
        self.labels.append(labels)
        self.answered += int((labels != ABSTAIN).sum())
        self.abstained += int((labels == ABSTAIN).sum())


def _unanswered(keys: list[bytes], answers: dict[bytes, int]) -> dict[bytes, int]:
    """First row index of each distinct key not answered yet (dedupes within the batch)."""
    fresh: dict[bytes, int] = {}
    for row, key in enumerate(keys):
        if key not in answers and key not in fresh:
            fresh[key] = row
    return fresh


def _checked_votes(vote_source: VoteSource, inputs: np.ndarray, count: int, failures: RateLimitedLog) -> np.ndarray:
    """The vote source's int64 histograms of ``count`` inputs, or ``TeachersUnavailable`` when it fails,
    returns malformed histograms, or a partial ensemble voted."""
    try:
        votes = np.asarray(vote_source.votes(inputs))
    except Exception as err:  # teachers' failures must not leak their details to clients
        # A missed deadline (``TeacherPool.vote_timeout_s``) says which; other errors only their type.
        failures("votes", "vote source failed: %s", err if isinstance(err, TimeoutError)
                 else type(err).__name__, level=logging.WARNING)
        raise TeachersUnavailable(f"teachers failed to vote ({type(err).__name__}); retry later") from err
    if votes.ndim != 2 or votes.shape[0] != count or not np.issubdtype(votes.dtype, np.integer) or (votes < 0).any():
        failures("malformed", "vote source returned %s %s for %d inputs", votes.dtype, votes.shape, count,
                 level=logging.ERROR)
        raise TeachersUnavailable("teachers returned malformed vote histograms")
    whole = vote_source.votes_per_query
    if whole is not None and (votes.sum(axis=1) != whole).any():
        # The charges assume the whole ensemble voted; a partial one must never answer.
        failures("partial", "vote histograms count %s votes, not %d",
                 np.unique(votes.sum(axis=1)).tolist(), whole, level=logging.ERROR)
        raise TeachersUnavailable("not every teacher voted; retry later")
    return votes.astype(np.int64)


class Pricing:
    """What the ledger pays for, as the labeller asks it: the worst case of a count of new inputs
    restated for the ledger's record-level relation, how many of them fit the budget, the refusal
    when none does, and the guarantee the ledger backs. Reads the ledger; never charges it."""

    def __init__(self, vote_source: VoteSource | SecureVoteSource, mechanism: VoteMechanism | SecureVoteMechanism,
                 ledger: AnsweringLedger, noise: NoisePolicy) -> None:
        self._vote_source, self._mechanism, self._ledger, self._noise = vote_source, mechanism, ledger, noise
        self._worst_cases: dict[int, PrivacyCharge] = {}  # by batch size, for stateless mechanisms
        self._guarantee: Guarantee | None = None

    def worst_case(self, count: int) -> PrivacyCharge:
        """The ledger-ready worst case of ``count`` new inputs, computed once per count when the
        mechanism is stateless (the accounting was a third of a single-input call)."""
        if not self._mechanism.stateless:
            return self.for_ledger(self._mechanism.worst_case_charge(count))
        if count not in self._worst_cases:
            self._worst_cases[count] = self.for_ledger(self._mechanism.worst_case_charge(count))
        return self._worst_cases[count]

    def for_ledger(self, charge: PrivacyCharge) -> PrivacyCharge:
        """The mechanism's one-vote charge restated for the ledger's record-level relation."""
        if charge.neighbouring == self._ledger.neighbouring:
            return charge
        relation = self._vote_source.neighbouring
        if relation != self._ledger.neighbouring:
            raise RuntimeError(f"the vote source does not say how one-vote charges hold for the ledger's "
                               f"'{self._ledger.neighbouring}' neighbours")
        return charge.for_records(relation, self._vote_source.neighbouring_lemma)

    def guarantee(self) -> Guarantee:
        """What this service can back: its ledger's budget, declared in advance (none without one).
        Fixed for the ledger's life, so worked out once."""
        if self._guarantee is None:
            self._guarantee = self._backed_guarantee()
        return self._guarantee

    def _backed_guarantee(self) -> Guarantee:
        report = self._ledger.report()
        reasons = (self._noise.unsound_reason,) if self._noise.unsound_reason else ()
        if report.guarantee is None:
            return unbounded_guarantee(report.delta, report.neighbouring,
                                       "no budget was declared: an open-ended service has no guarantee "
                                       "(epsilon_spent is the realised spend, not a bound)").marked(reasons)
        return report.guarantee.marked(reasons)

    def affordable(self, limit: int) -> int:
        """How many new inputs, in [0, ``limit``], the ledger (with the owners' lifetime budgets it
        checks) pays for now in the worst case: the longest prefix a batch gets answered; ``limit``
        without a declared budget. Worst cases depend on the count alone and grow with it, so a
        bisection on the count finds it. It reads only the ledger's charges, whose realised spend
        the budget reply already publishes, and a client learns the same from which inputs of a
        ``limit``-batch are refused: it reveals nothing new."""
        if limit < 1:
            raise InvalidValue(f"limit must be >= 1, got {limit}")
        if self._ledger.can_afford(self.worst_case(limit)):
            return limit
        paid, unpaid = 0, limit
        while unpaid - paid > 1:
            middle = (paid + unpaid) // 2
            if self._ledger.can_afford(self.worst_case(middle)):
                paid = middle
            else:
                unpaid = middle
        return paid

    def fit(self, count: int) -> int:
        """``affordable(count)``, or ``BudgetExceeded`` when not one new input fits."""
        paid = self.affordable(count)
        if paid == 0:
            raise self.exhausted(count)
        if paid < count:
            log.debug("budget pays for %d of %d new inputs in a batch: the rest are refused", paid, count)
        return paid

    def exhausted(self, count: int, elsewhere: str | None = None) -> BudgetExceeded:
        """The refusal of ``count`` new inputs (the caller's own: never a group's, which would tell it
        how many other clients asked meanwhile); ``elsewhere``: why, where this ledger did not refuse
        (an owner's lifetime budget at its gateway, or the rounds the owners admitted, all used)."""
        inputs = f"{count} new input{'' if count == 1 else 's'}"
        if elsewhere is not None:
            return BudgetExceeded(f"privacy budget exhausted: labelling {inputs}: {elsewhere}")
        report = self._ledger.report()
        return BudgetExceeded(
            f"privacy budget exhausted: labelling {inputs} could cost more than the budget "
            f"ε={report.epsilon_limit:.4g} at δ={report.delta:g} has left (realised spend ε={report.epsilon_spent:.4g})"
        )


class PrivateLabeller:
    """Private labels for inputs from ``vote_source``, paid for from ``ledger`` (the run's or the
    service's; owners behind gateways charge their own ledgers there, each round).

    ``noise`` is the run's noise policy (OS entropy by default). The answers already in the
    ledger (from an earlier run of the service) are answered again, free.
    """

    def __init__(self, vote_source: VoteSource, mechanism: VoteMechanism, ledger: AnsweringLedger,
                 noise: NoisePolicy = SECURE, group_limit: int = GROUP_LIMIT) -> None:
        check_pairing(vote_source, mechanism)
        self.vote_source = vote_source
        self.mechanism = mechanism
        self.ledger = ledger
        self.noise = noise
        self._rng = noise.source("aggregator").rng
        # One lock around the charge step: record check, mechanism (may be stateful), ledger, record write.
        self._lock = threading.Lock()
        self._answers: dict[bytes, int] = ledger.answers.read()
        self.pricing = Pricing(vote_source, mechanism, ledger, noise)
        self._failures = RateLimitedLog(log)  # every call fails alike when the teachers do
        # Votes coupled across the batch (public clusters): each call its own batch and release,
        # so that a call's labels depend on its own inputs alone, never on another client's.
        self._groups: GroupCommit[_Asked, int] = GroupCommit(self._label_group, limit=group_limit,
                                                             size=lambda asked: len(asked.fresh),
                                                             merge=not vote_source.batch_coupled)
        self._counters = _Counters.on_record(self._answers)
        if self._answers:
            log.info("%d answers on record in %s: repeated inputs get them again, free", len(self._answers), ledger.path)

    def label(self, inputs: np.ndarray) -> LabelOutcome:
        """Labels for validated float32 inputs [batch, *input_shape], new inputs answered up to
        what the budget pays (the rest refused); ``BudgetExceeded`` when it pays for none of
        them and none of the batch is on record, ``TeachersUnavailable`` when the teachers cannot vote.

        Concurrent calls share one vote call, mechanism call and ledger transaction
        (``GroupCommit``): a batch's new inputs are paid for in the order the calls arrived.
        Not where the vote source is ``batch_coupled``: there each call's new inputs are one batch,
        one release, of their own."""
        keys = input_keys(inputs)
        newly_answered = 0
        while True:
            with self._lock:
                fresh = _unanswered(keys, self._answers)
            if not fresh:
                break
            try:
                answered = self._groups.run(_Asked(inputs, fresh))
            except BudgetExceeded as err:
                with self._lock:
                    on_record = any(key in self._answers for key in keys)
                if not on_record:  # refuse it whole, counting this call's inputs: the group's are others' too
                    # why this ledger refuses it; None: an owner's budget or its admission did
                    ours = self.ledger.refusal(self.pricing.worst_case(len(fresh)))
                    raise self.pricing.exhausted(len(fresh), elsewhere=None if ours else str(err)) from None
                break
            newly_answered += answered
            # Calls earlier in the group may have taken what was left: try again alone while the
            # budget pays for one more input (a data-independent check), else refuse the rest.
            if answered or not self.ledger.can_afford(self.pricing.worst_case(1)):
                break
        with self._lock:
            labels = np.array([self._answers.get(key, ABSTAIN) for key in keys], dtype=np.int64)
            refused = np.array([key not in self._answers for key in keys], dtype=bool)
            if refused.all() and newly_answered == 0:
                raise self.pricing.exhausted(len(set(keys)))
            self._counters.cache_hits += len(keys) - newly_answered - int(refused.sum())
        return LabelOutcome(labels, refused)

    def on_record(self, inputs: np.ndarray) -> LabelOutcome | None:
        """The released answers for ``inputs`` when every one is on record — a repeat costs
        nothing and needs no teacher — else None."""
        keys = input_keys(inputs)
        with self._lock:
            if any(key not in self._answers for key in keys):
                return None
            self._counters.cache_hits += len(keys)
            labels = np.array([self._answers[key] for key in keys], dtype=np.int64)
        return LabelOutcome(labels, np.zeros(len(keys), dtype=bool))

    def _label_group(self, group: list[_Asked]) -> list[int]:
        """The new inputs of concurrent calls answered together (``GroupCommit``'s work): how many
        of each call's were answered."""
        if len(group) == 1:
            inputs, fresh = group[0].inputs, group[0].fresh
        else:
            rows: dict[bytes, np.ndarray] = {}
            for asked in group:
                for key, row in asked.fresh.items():
                    rows.setdefault(key, asked.inputs[row])
            inputs, fresh = np.stack(list(rows.values())), {key: row for row, key in enumerate(rows)}
        answered = self._label_fresh(inputs, fresh)
        return [sum(key in answered for key in asked.fresh) for asked in group]

    def _label_fresh(self, inputs: np.ndarray, fresh: dict[bytes, int]) -> set[bytes]:
        """Answer the inputs not on record (the row of each key), up to what the budget pays;
        returns the keys answered."""
        # Data-independent early sizing: no point asking teachers for votes we may not release.
        count = self.pricing.fit(len(fresh))
        fresh = dict(itertools.islice(fresh.items(), count))
        fresh_votes = _checked_votes(self.vote_source, inputs[list(fresh.values())], count, self._failures)
        with self._lock:
            return self._answer_fresh(fresh, fresh_votes)

    def _answer_fresh(self, fresh: dict[bytes, int], fresh_votes: np.ndarray) -> set[bytes]:
        """Mechanism → ledger (with the answers) → release, for inputs still unanswered, up to
        what the budget pays (returns their keys); the caller holds the lock."""
        # Another request may have answered some of these, or spent budget, while we waited for
        # the teachers; sized again before the (possibly stateful) mechanism runs.
        keep = [i for i, key in enumerate(fresh) if key not in self._answers]
        if not keep:
            return set()
        keep = keep[: self.pricing.fit(len(keep))]
        keys = [key for key in fresh if key not in self._answers][: len(keep)]
        votes = fresh_votes[keep]
        worst = self.pricing.worst_case(len(keep))
        result = self.mechanism(votes, self._rng)
        labels = np.asarray(result.labels, dtype=np.int64)
        if labels.shape != (len(keep),):
            raise RuntimeError(f"mechanism {self.mechanism.name} returned {labels.shape} labels for {len(keep)} inputs")
        answers = dict(zip(keys, labels.tolist()))
        charge = self.pricing.for_ledger(result.charge)
        if charge.is_free:  # e.g. inside an open stability run, paid for when it opened
            self.ledger.answers.record(answers)
        else:  # raises only with nothing recorded (BudgetExceeded, a ledger it cannot write): nothing released
            self.ledger.charge(charge, worst_case=worst, answers=answers)
        # Recorded: kept at once, so that whatever follows, a retry gets these labels again, free.
        self._answers.update(answers)
        self._counters.votes.append(votes)
        self._counters.count(labels)
        result.commit()
        return set(answers)

    def guarantee(self) -> Guarantee:
        """What this service can back (``Pricing.guarantee``)."""
        return self.pricing.guarantee()

    def answered_votes(self) -> tuple[np.ndarray, np.ndarray]:
        """(votes int64 [m, k], answered bool [m]) for every input the mechanism saw in this
        process, in order: what the run's privacy report analyses (abstentions cost privacy too)."""
        with self._lock:
            if not self._counters.votes:
                classes = int(self.vote_source.num_classes)
                return np.zeros((0, classes), dtype=np.int64), np.zeros(0, dtype=bool)
            return np.concatenate(self._counters.votes), np.concatenate(self._counters.labels) != ABSTAIN

    def budget(self, limit: int = GROUP_LIMIT) -> BudgetStatus:
        """The budget reply; ``affordable_queries`` counts up to ``limit`` (the server's largest batch)."""
        with self._lock:
            counters = self._counters
            answered, abstained, hits = counters.answered, counters.abstained, counters.cache_hits
        report = self.ledger.report()
        return BudgetStatus(report.epsilon_spent, report.delta, report.epsilon_limit, self.mechanism.name,
                            self.guarantee(), answered, abstained, hits, self.pricing.affordable(limit))


class _Rounds:
    """The secure rounds of one batch, as the mechanism asks for them. A round is charged (at the σ
    it runs with) when its shares are asked for, before any could arrive: from then on whoever
    holds this process could decode it, even from a share that comes after the round was given
    up. So a round that fails after that point stays charged; one that fails before (an owner
    sent no key) is not. Each is paid with its worst case beside it, the round over every row of
    the batch (a round on the confident rows only is the same release with the rest withheld),
    which the run's guarantee composes where the run charged more than it planned."""

    def __init__(self, source: SecureVoteSource, inputs: np.ndarray, noise: NoisePolicy, label: str,
                 pay: Callable[[PrivacyCharge, PrivacyCharge], None], failures: RateLimitedLog,
                 bound: VoteBound) -> None:
        self._source, self._inputs, self._noise, self._label, self._bound = source, inputs, noise, label, bound
        self._pay, self._failures = pay, failures
        self.charged = 0  # rounds charged: their shares were asked for

    def noised(self, rows: np.ndarray, sigma: float) -> np.ndarray:
        release = SkellamVotes(sigma, self._bound)
        paid, unpaid = False, None  # unpaid: why the ledger did not take the charge

        def charge() -> None:
            nonlocal paid, unpaid
            if paid:  # once per round, whatever the source does
                return
            try:
                self._pay(release.charge(len(rows), self._label), release.charge(len(self._inputs), self._label))
            except BaseException as err:
                unpaid = err
                raise
            paid = True
            self.charged += 1

        try:
            totals = np.asarray(self._source.noised_votes(self._inputs[rows], release, self._noise, charge))
        except BudgetExceeded:
            raise  # an owner's lifetime budget refused the round on its side (a gateway's): nothing released
        except OwnerDropout as err:
            raise TeachersUnavailable(f"{err}; retry later") from err
        except Exception as err:  # teachers' failures must not leak their details to clients
            if err is unpaid:
                raise  # the budget refused the round, or its charge could not be written: nothing was asked
            self._failures("round", "secure vote round failed: %s", type(err).__name__, level=logging.WARNING)
            raise TeachersUnavailable(f"teachers failed to vote ({type(err).__name__}); retry later") from err
        charge()  # a source that released totals without charging first: their release is paid all the same
        if totals.ndim != 2 or totals.shape[0] != len(rows) or not np.issubdtype(totals.dtype, np.integer):
            self._failures("malformed", "secure vote round returned %s %s for %d inputs", totals.dtype, totals.shape,
                           len(rows), level=logging.ERROR)
            raise TeachersUnavailable("teachers returned malformed vote totals")
        return totals.astype(np.int64)


class SecureLabeller(PrivateLabeller):
    """``PrivateLabeller`` for ``aggregation: secure``: the mechanism runs on rounds of the secure
    sum (module docstring), so this process never holds a clean vote histogram."""

    vote_source: SecureVoteSource
    mechanism: SecureVoteMechanism

    def __init__(self, vote_source: SecureVoteSource, mechanism: SecureVoteMechanism, ledger: AnsweringLedger,
                 noise: NoisePolicy = SECURE, group_limit: int = GROUP_LIMIT) -> None:
        super().__init__(vote_source, mechanism, ledger, noise, group_limit)
        self._batch = threading.Lock()  # held by one batch from its worst-case check to its last round

    def _label_fresh(self, inputs: np.ndarray, fresh: dict[bytes, int]) -> set[bytes]:
        # One batch at a time from the worst-case check to the last round's charge: no other batch
        # may spend the budget between them, so every round of the batch fits. Each round is charged
        # as its shares are asked for (``_Rounds``); the answers are recorded only once every round
        # is in and the labels go back to the callers: an aborted batch records no answer. The
        # answers' lock is not held over the rounds (up to a round deadline each): calls arriving
        # meanwhile join the next group, and share this batch's failure rather than wait for their
        # own deadline after it; budget replies and repeats are answered meanwhile.
        with self._batch:
            with self._lock:
                keys = [key for key in fresh if key not in self._answers]
            if not keys:
                return set()
            keys = keys[: self.pricing.fit(len(keys))]
            rounds = _Rounds(self.vote_source, inputs[[fresh[key] for key in keys]], self.noise, self.mechanism.name,
                             lambda charge, worst: self.ledger.charge(self.pricing.for_ledger(charge),
                                                                      worst_case=self.pricing.for_ledger(worst)),
                             self._failures,
                             self.mechanism.vote_bound)
            try:
                labels = np.asarray(self.mechanism.answer(rounds.noised, len(keys)), dtype=np.int64)
            except Exception as err:
                if isinstance(err, TeachersUnavailable):
                    self._failures("dropout", "%s (%s)", err,
                                   f"{rounds.charged} round(s) of the batch charged as asked, no label released"
                                   if rounds.charged else "nothing released or charged", level=logging.WARNING)
                raise
            if labels.shape != (len(keys),):
                raise RuntimeError(f"mechanism {self.mechanism.name} returned {labels.shape} labels for "
                                   f"{len(keys)} inputs")
            answers = dict(zip(keys, labels.tolist()))
            with self._lock:  # paid for round by round, as each was asked: kept at once, for repeats
                self._answers.update(answers)
                self._counters.count(labels)
            try:
                self.ledger.answers.record(answers)
            except Exception as err:  # noqa: BLE001 - charged already: released all the same, never "nothing charged"
                # Repeated from memory; a restart that cannot repeat them pays for them again (more, never less).
                self._failures("record", "the answers of a charged batch were not recorded, only kept in memory: %s",
                               err, level=logging.ERROR)
            return set(answers)

    def answered_votes(self) -> tuple[np.ndarray, np.ndarray]:
        raise RuntimeError("aggregation: secure: the aggregator never sees clean votes, so it has none to analyse")


def labeller_for(vote_source: VoteSource | SecureVoteSource, mechanism: VoteMechanism | SecureVoteMechanism,
                 ledger: AnsweringLedger, noise: NoisePolicy = SECURE) -> PrivateLabeller:
    """The labeller for ``mechanism``: on secure-sum rounds for a ``SecureVoteMechanism``, on clean
    histograms otherwise."""
    if isinstance(mechanism, SecureVoteMechanism):
        return SecureLabeller(vote_source, mechanism, ledger, noise)
    return PrivateLabeller(vote_source, mechanism, ledger, noise)
