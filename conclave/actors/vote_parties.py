"""Vote parties: the actors on the owners' nodes that turn public queries into vote histograms —
teacher groups, kNN shards, public-cluster shards — and the driver's handle on them.

Every vote source works the same way from the outside. Each party (an actor holding one block of
one owner's data) counts its own partial histogram ``int64[batch, classes]`` of a batch of
queries, on its node. What leaves it depends on the trust the run asks for:

- **secure rounds** (``VoteParties.noised_votes``, the only mode across owners): each party
  returns ONE masked share of its partial histogram plus its Skellam noise share
  (``privacy.secure_votes``); the driver adds the shares and decodes the noised total. No clean
  histogram, partial or whole, reaches the driver.
- **clean partials** (``VoteParties.votes``): each party returns its partial histogram and the
  driver adds them — only where every record belongs to one owner whose node also runs the
  aggregator (the classic PATE mode), which the configs check.

The driver also watches the parties' health (``ready``, through ``ActorRoster``): a party that
died past Ray's restarts is started again as it was first started, so a service recovers, and
calls abandoned past their deadline are cancelled with every reference dropped.
"""
from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import ray

from conclave.actors.owners import OwnerDropout
from conclave.actors.placement import release, require_node
from conclave.errors import InvalidValue
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_release import ReleaseKeys
from conclave.privacy.secure_sum import SecureSumPlan
from conclave.privacy.secure_votes import SkellamVotes

log = logging.getLogger(__name__)

# Query batches up to this size ride inline with each actor call rather than through the object
# store (Ray itself inlines arguments below 100 KiB).
INLINE_INPUT_BYTES = 64 * 1024


class RecordSource(Protocol):
    """Where one owner's records are read from, in the actor that holds them
    (``actors.owners.OwnerSource``, or a benchmark's private split, ``actors.teacher.TeacherSource``)."""

    owner: str
    num_teachers: int  # shards the records are cut into (by a keyed hash of each record)
    features: str | None
    records: int | None  # a cap on the records each shard keeps (None: none)

    def load(self, shard_ids: Sequence[int]) -> list: ...


@dataclass(frozen=True)
class RecordShare:
    """One owner's records voting themselves (kNN or public-cluster votes): its source (all of its
    ``num_teachers`` shards vote), on how many actors (each a contiguous block of shards), and the
    records it declares (public; owner-local kNN votes give it that share of k). Set
    no ``records`` cap on an ``OwnerSource``: cutting a shard down would turn adding a record into
    replacing one."""

    source: RecordSource
    num_actors: int = 1
    declared: int | None = None

    def __post_init__(self) -> None:
        if self.num_actors < 1:
            raise InvalidValue(f"num_actors must be >= 1, got {self.num_actors}")
        if self.declared is not None and self.declared < 1:
            raise InvalidValue(f"owner {self.source.owner}: declared records must be >= 1, got {self.declared}")
        if self.source.records is not None:
            raise InvalidValue(f"owner {self.source.owner}: leave records unset when records vote (a cap replaces "
                             "records; Poisson sampling covers any number held)")
        if self.source.features is not None:
            raise InvalidValue(f"owner {self.source.owner}: give the representation as the embedding, "
                             f"not as source features ({self.source.features!r})")

    def declared_rows(self, first: int, last: int) -> int | None:
        """The records a party holding shards ``first``..``last - 1`` is declared to hold (its share
        of the owner's declaration, rounded up; None without one)."""
        if self.declared is None:
            return None
        return max(1, -(-self.declared * (last - first) // self.source.num_teachers))


class VoteParty(ReleaseKeys, abc.ABC):
    """One party's side (no Ray here: the actor is the subclass itself): its partial histogram of
    a batch of queries, and its masked share of a secure round made from it."""

    @abc.abstractmethod
    def partial_votes(self, queries: np.ndarray, stream: str) -> np.ndarray:
        """``int64[batch, classes]``: this party's votes on ``queries`` (what ``VoteParties.queries``
        made of the inputs); ``stream`` names any randomness the counting draws (a kNN sample)."""

    def vote_share(self, queries: np.ndarray, release: SkellamVotes, plan: SecureSumPlan, owners: tuple[str, ...],
                   public_keys: tuple[bytes, ...], session: str, noise: NoisePolicy) -> np.ndarray:
        """This party's masked share of one secure round (its key pair from ``mask_key`` just before):
        its partial histogram, plus its Skellam noise share drawn here, under pairwise masks. The
        histogram itself never leaves."""
        keys = self._take_mask_keys(public_keys)
        votes = self.partial_votes(queries, f"{session}/votes/{keys.rank}")
        return release.share(votes, plan, owners, keys.pairwise_masks(public_keys, session),
                             noise.source(f"{session}/{keys.rank}"))


class VoteParties(abc.ABC):
    """The driver's handle on one vote source's parties: their votes and secure rounds, their
    health and recovery kept by an ``ActorRoster``.

    A subclass starts its parties with ``_track`` (one spawn per party: how to start it again,
    and each party's owner), keeps ``num_classes`` and ``input_shape``, and says how
    inputs become the parties' queries (``queries``), how a party's health is probed (``_probe``),
    and the most each party can count in one cell of a histogram (``cell_bounds``: public, it
    sizes the secure sum's ring).
    """

    max_replacements: int = 3  # new actors for one that died past Ray's restarts
    actor_kind: str = "actor"
    restart_note: str = ""
    # How long one secure round (keys and shares) waits for every party: below the client's
    # default deadline (30 s, ``cluster.client``) with room for Confident-GNMax's two rounds, so a
    # stopped owner fails the call UNAVAILABLE rather than outliving it.
    share_timeout_s: float = 12.0
    vote_timeout_s: float = 15.0  # a clean vote call, also below the client's deadline
    num_classes: int
    input_shape: tuple[int, ...]
    votes_per_query: int | None  # ``actors.labeller.VoteSource``: each subclass declares both
    batch_coupled: bool
    local: bool = False  # ``actors.labeller.VoteSource.local``: owner-local kNN sets it
    sample_rate: float | None = None  # ``actors.labeller.VoteSource.sample_rate``: kNN sets it
    votes_per_record: int | None = None  # ``actors.labeller.VoteSource.votes_per_record``: public clusters set it

    def _track(self, spawns: list[Callable[[], ray.actor.ActorHandle]], owners: list[str], cpus_each: float) -> None:
        """Start one party per spawn, owned by ``owners[i]`` and reserving ``cpus_each`` CPUs, and
        keep how to start it again."""
        self.roster = ActorRoster(spawns, owners, cpus_each, self.actor_kind, self.restart_note, self.max_replacements)
        self._rounds = 0  # rounds so far: each names its key session and its parties' random streams

    @property
    def num_actors(self) -> int:
        return len(self.roster.actors)

    @abc.abstractmethod
    def queries(self, inputs: np.ndarray) -> np.ndarray:
        """What the parties are sent for validated ``inputs``: the inputs, or their public embedding."""

    @abc.abstractmethod
    def cell_bounds(self) -> list[int]:
        """The most each party counts in one (query, class) cell, from public figures."""

    @abc.abstractmethod
    def _probe(self, actor: ray.actor.ActorHandle) -> ray.ObjectRef:
        """A call with a thread of its own in the actor that says whether it can vote."""

    def checked(self, inputs: np.ndarray) -> np.ndarray:
        inputs = np.ascontiguousarray(inputs, dtype=np.float32)
        if inputs.shape[1:] != self.input_shape:
            raise InvalidValue(f"inputs of shape {inputs.shape[1:]} per example; the owners' data are {self.input_shape}")
        return inputs

    def _next_session(self, kind: str) -> str:
        self._rounds += 1
        return f"{kind}/{self._rounds}"

    def partials(self, inputs: np.ndarray) -> list[np.ndarray]:
        """Every party's clean partial histogram of ``inputs`` (the trusted single-owner mode only)."""
        queries = self.queries(self.checked(inputs))
        shared = ray.put(queries) if queries.nbytes > INLINE_INPUT_BYTES else queries
        stream = self._next_session("votes")
        calls = [actor.partial_votes.remote(shared, f"{stream}/{rank}")
                 for rank, actor in enumerate(self.roster.actors)]
        try:
            return ray.get(calls, timeout=self.vote_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.roster.abandon(calls)
            calls.clear()
            raise TimeoutError(f"the {self.actor_kind}s gave no votes within {self.vote_timeout_s:g} s") from None

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """Vote histogram ``int64[batch, num_classes]``: the parties' clean partials added."""
        return np.sum(self.partials(inputs), axis=0, dtype=np.int64)

    def noised_votes(self, inputs: np.ndarray, release: SkellamVotes, noise: NoisePolicy,
                     charge: Callable[[], None]) -> np.ndarray:
        """One secure round (``privacy.secure_votes``): the histograms ``int64[batch, num_classes]``
        summed through the secure sum with Skellam noise of variance ``release.sigma``² against any
        one owner. Every party makes a fresh key pair, returns only its masked share, and the shares
        are added and decoded here: no clean histogram, partial or whole, reaches this process.

        ``charge`` is called once the keys are in and before any share is asked for: from then on
        the round is a release to whoever holds this process — honest code drops an abandoned
        round, but a curious aggregator could keep its shares and decode them once a late one
        arrives — so it is paid for first, and if ``charge`` raises nothing is asked.

        The whole round, keys and shares, has ``share_timeout_s``. A party that dies, or sends no
        key or share in time, aborts the round: ``OwnerDropout`` names its owner. Shares not in
        are cancelled and every reference to the round's shares dropped (a timed-out Ray task's
        result still arrives otherwise), so nothing of it is decoded here. Rounds must not overlap
        (a party holds one key pair at a time): the secure labeller runs one at a time.
        """
        queries = self.queries(self.checked(inputs))
        session = self._next_session("secure-votes")  # fresh key pairs every round; names the noise streams
        actors, owners = self.roster.actors, tuple(self.roster.owners)
        plan = release.plan(len(queries), self.num_classes, owners, self.cell_bounds())
        deadline = time.monotonic() + self.share_timeout_s
        public_keys = self.roster.gather([actor.mask_key.remote(rank) for rank, actor in enumerate(actors)],
                                         deadline, self.share_timeout_s, "no key for",
                                         "no share was asked, so nothing was released or charged")
        charge()
        shared = ray.put(queries)
        refs = [actor.vote_share.remote(shared, release, plan, owners, tuple(public_keys), session, noise)
                for actor in actors]
        del shared
        shares = self.roster.gather(refs, deadline, self.share_timeout_s, "no share of",
                                    "its shares were asked, so it was charged; nothing of it is decoded")
        return release.total(shares, plan, len(queries))

    def ready(self, timeout: float = 2.0) -> bool:
        """Whether every party is up and can vote (``ActorRoster.ready``)."""
        return self.roster.ready(self._probe, timeout)

    def stop(self) -> None:
        """Stop the actors (what they hold goes with them) and wait for their CPUs to be free."""
        self.roster.stop()


class ActorRoster:
    """The live actors of one vote source, each with its owner: whether they can vote, starting
    again one that died past Ray's restarts, giving up calls past their deadline, and stopping."""

    def __init__(self, spawns: list[Callable[[], ray.actor.ActorHandle]], owners: list[str], cpus_each: float,
                 kind: str, restart_note: str, max_replacements: int) -> None:
        self._spawns, self.owners, self._cpus_each = spawns, owners, cpus_each
        self._kind, self._restart_note, self._max_replacements = kind, restart_note, max_replacements
        self.actors = [spawn() for spawn in spawns]
        self._replaced = [0] * len(spawns)
        # Markers queued behind calls abandoned past their deadline: an actor whose marker has
        # not run is still busy with an abandoned call (e.g. stopped), and cannot vote yet.
        self._late: set[ray.ObjectRef] = set()

    def ready(self, probe: Callable[[ray.actor.ActorHandle], ray.ObjectRef], timeout: float) -> bool:
        """Whether every party is up and can vote (False while one restarts). The ``probe`` has its
        own thread in each actor, so a long vote does not delay it; a call abandoned past its
        deadline and still running means that actor is hung (e.g. stopped) until it ends."""
        if self._late:
            done, _ = ray.wait(list(self._late), num_returns=len(self._late), timeout=0)
            self._late.difference_update(done)
            if self._late:
                return False
        probes = [probe(actor) for actor in self.actors]
        answered, _ = ray.wait(probes, num_returns=len(probes), timeout=timeout)
        if len(answered) < len(probes):
            return False
        alive = True
        for index, answer in enumerate(probes):
            try:
                alive = bool(ray.get(answer)) and alive
            except ray.exceptions.ActorDiedError:  # beyond its restarts: a new actor, started as the first
                self._replace(index)
                alive = False
            except ray.exceptions.RayError:  # restarting, or unreachable for now
                alive = False
        return alive

    def _replace(self, index: int) -> None:
        """Start actor ``index`` again as it was first started (``restart_note`` says what it
        reloads). At most ``max_replacements`` times per actor: one that keeps dying stays down
        (NOT_SERVING)."""
        if self._replaced[index] >= self._max_replacements:
            return
        self._replaced[index] += 1
        log.warning("%s %d is gone for good (past its restarts); starting it again%s (%d of %d)", self._kind,
                    index, self._restart_note, self._replaced[index], self._max_replacements)
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._spawns[index]()

    def abandon(self, calls: list[ray.ObjectRef]) -> None:
        """Give up calls past their deadline, one per actor: cancel those not done (a queued call
        never runs; a running one's result is never delivered, ``TaskCancelledError``) and queue a
        marker behind each, which ``ready`` waits for. The caller drops its references to the
        calls: nothing of an abandoned call reaches this process later."""
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        finished = set(done)
        for actor, call in zip(self.actors, calls):
            if call not in finished:
                ray.cancel(call)
                self._late.add(actor.describe.remote())  # runs once the abandoned call has ended

    def stop(self) -> None:
        """Stop the actors (what they hold goes with them) and wait for their CPUs to be free."""
        actors, self.actors = self.actors, []
        release(actors, self._cpus_each)

    def gather(self, refs: list[ray.ObjectRef], deadline: float, timeout_s: float, missing: str,
               outcome: str) -> list:
        """Every party's answer to one step of a secure round by ``deadline`` (the round's
        ``timeout_s`` after it began), or ``OwnerDropout`` naming the owner who sent ``missing`` the
        round (``outcome``: what that leaves). On the way out the calls not done are cancelled and
        ``refs`` is emptied: no reference is kept."""
        try:
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            late = [owner for owner, ref in zip(self.owners, refs) if ref in pending]
            done.clear()
            pending.clear()
            if late:
                self.abandon(refs)
                raise OwnerDropout(f"owner {late[0]} sent {missing} a secure vote round within "
                                   f"{timeout_s:g} s: the round is aborted; {outcome}")
            answers = []
            for owner, ref in zip(self.owners, refs):
                try:
                    answers.append(ray.get(ref))
                except ray.exceptions.RayActorError:
                    raise OwnerDropout(f"owner {owner} dropped out of a secure vote round (its actor died): the "
                                       f"round is aborted; {outcome}") from None
            return answers
        finally:
            refs.clear()


@dataclass(frozen=True)
class PartyPlan:
    """One owner's share and its parties' blocks of shards."""

    share: RecordShare
    blocks: list[tuple[int, int]]


def plan_parties(shares: Sequence[RecordShare], num_cpus_per_actor: float, what: str) -> list[PartyPlan]:
    """Every owner's parties, checked before any actor starts: one line naming the owner (``what``:
    its actors, as in "owner a's kNN shards") when no node can take them."""
    plans = []
    for share in shares:
        require_node(f"owner {share.source.owner}'s {what}", num_cpus_per_actor)
        plans.append(PartyPlan(share, party_blocks(share.source.num_teachers, share.num_actors)))
    return plans


def party_blocks(count: int, parties: int) -> list[tuple[int, int]]:
    """``count`` shards cut into at most ``parties`` contiguous blocks, sizes differing by at most one."""
    bounds = np.linspace(0, count, min(parties, count) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def declared_share(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` cut in proportion to ``weights`` (public: declared counts), each at least 1."""
    whole = float(sum(weights))
    return [max(1, round(total * w / whole)) for w in weights]
