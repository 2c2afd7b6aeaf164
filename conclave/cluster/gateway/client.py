"""The coordinator's side of the owner protocol: one mTLS channel per owner's gateway, and a secure
vote source over several gateways for ``actors.labeller.SecureLabeller``.

``GatewayVoteSource`` runs each secure round as the gateways allow: every gateway's signed key for
the round (in parallel, within a deadline), the coordinator's own charge (its view; each owner's
ledger charged on its own machine is the authority), every gateway's masked share, then the sum,
decoded on the plan the signed keys fix. It holds no owner's data and no clean histogram; a gateway
that fails a round aborts it, ``OwnerDropout`` naming the owner.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc
import numpy as np

from conclave.actors.owners import OwnerDropout
from conclave.actors.vote_parties import declared_share
from conclave.cluster.run_privacy import GatewayAccount
from conclave.errors import ConclaveError, InvalidValue
from conclave.cluster.gateway.identity import ForgedKey, RoundKey, Verifier
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.learning.data.sources import PublicReading
from conclave.learning.embeddings import Embedding
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import BudgetExceeded
from conclave.privacy.accounting.owner_policy import OwnerRefused
from conclave.privacy.mechanisms.private_knn import KNN_LEMMA
from conclave.privacy.mechanisms.public_clusters import CLUSTER_LEMMA
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_votes import SkellamVotes
from conclave.protos import owner_pb2, owner_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorTls:
    """The coordinator's certificate and key (issued by the consortium CA) and the CA itself."""

    certificate: Path
    key: Path
    ca: Path


class OwnerGateway:
    """One owner's gateway at ``endpoint`` (host:port), over mutual TLS."""

    def __init__(self, endpoint: str, tls: CoordinatorTls, timeout_s: float = 30.0) -> None:
        self.endpoint, self.timeout_s = endpoint, timeout_s
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca).read_bytes(),
                                                   private_key=Path(tls.key).read_bytes(),
                                                   certificate_chain=Path(tls.certificate).read_bytes())
        self._channel = grpc.secure_channel(endpoint, credentials, options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)])
        self._stub = owner_pb2_grpc.OwnerStub(self._channel)

    def describe(self, timeout_s: float | None = None) -> owner_pb2.Description:
        return self._stub.Describe(owner_pb2.DescribeRequest(), timeout=timeout_s or self.timeout_s)

    def admit(self, request: owner_pb2.AdmitRequest, timeout_s: float = 120.0) -> owner_pb2.AdmitReply:
        # It starts the owner's actors, and trains teachers: at least the calls' deadline.
        return self._stub.Admit(request, timeout=max(self.timeout_s, timeout_s))

    def keys(self, run: str, round_: int, batch: int, timeout_s: float | None = None) -> owner_pb2.SignedKey:
        return self._stub.Keys(owner_pb2.KeysRequest(run=run, round=round_, batch=batch),
                               timeout=timeout_s or self.timeout_s)

    def votes(self, request: owner_pb2.VotesRequest, timeout_s: float | None = None) -> owner_pb2.VotesReply:
        return self._stub.Votes(request, timeout=timeout_s or self.timeout_s)

    def step(self, request: owner_pb2.StepRequest, timeout_s: float | None = None) -> owner_pb2.StepReply:
        return self._stub.Step(request, timeout=timeout_s or self.timeout_s)

    def near_private(self, request: owner_pb2.NearPrivateRequest, timeout_s: float | None = None
                     ) -> owner_pb2.StepReply:
        return self._stub.NearPrivate(request, timeout=timeout_s or self.timeout_s)

    def budget(self) -> owner_pb2.BudgetReply:
        return self._stub.Budget(owner_pb2.BudgetRequest(), timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()


# Each vote source's terms declare what ``actors.labeller`` reads of a source (the record-level
# relation's lemma, whether a record's vote depends on the batch, what ``check_pairing`` compares)
# and write their own part of each owner's ``AdmitRequest`` (``admitted``).


@dataclass(frozen=True)
class ClusterVotes:
    """Public-cluster votes through the gateways: each record votes for its m nearest queries."""

    votes_per_record: int
    embedding: str = "pca"
    dims: int = 16
    lemma: ClassVar[str] = CLUSTER_LEMMA
    batch_coupled: ClassVar[bool] = True  # a record votes for its m nearest queries of the batch
    takes_pool: ClassVar[bool] = True  # each gateway fits the embedding on the public pool
    teachers_vote: ClassVar[bool] = False
    sample_rate: ClassVar[float | None] = None

    def admitted(self, records: Sequence[int]) -> list[dict[str, object]]:
        """Each owner's terms, as ``AdmitRequest`` fields (``records``: their declared records)."""
        terms = owner_pb2.ClusterTerms(votes_per_record=self.votes_per_record, embedding=self.embedding,
                                       dims=self.dims)
        return [{"clusters": terms} for _ in records]


@dataclass(frozen=True)
class KnnVotes:
    """kNN votes through the gateways: k shared among the owners by their declared records."""

    k: int
    sample_rate: float
    embedding: str = "pca"
    dims: int = 16
    lemma: ClassVar[str] = KNN_LEMMA
    batch_coupled: ClassVar[bool] = False
    takes_pool: ClassVar[bool] = True
    teachers_vote: ClassVar[bool] = False
    votes_per_record: ClassVar[int | None] = None

    def admitted(self, records: Sequence[int]) -> list[dict[str, object]]:
        return [{"knn": owner_pb2.KnnTerms(k=share, sample_rate=self.sample_rate, embedding=self.embedding,
                                           dims=self.dims)} for share in declared_share(self.k, records)]


@dataclass(frozen=True)
class TeacherVotes:
    """Teachers trained at each gateway on its owner's records, with a registered ``model``:
    ``teachers`` in all, shared among the owners by their declared records, or one count per
    gateway (in order). ``seed``: the teachers' initialisation and batch order (the shards are the
    gateways' own)."""

    teachers: int | tuple[int, ...]
    model: str
    epochs: int = 10
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0
    lemma: ClassVar[str] = SHARD_LEMMA  # as ``TeacherPool`` declares it
    batch_coupled: ClassVar[bool] = False
    takes_pool: ClassVar[bool] = False  # teachers learn on the owners' records only
    teachers_vote: ClassVar[bool] = True  # each teacher votes once per query
    votes_per_record: ClassVar[int | None] = None
    sample_rate: ClassVar[float | None] = None

    def admitted(self, records: Sequence[int]) -> list[dict[str, object]]:
        return [{"teachers": owner_pb2.TeacherTerms(model=self.model, teachers=count, epochs=self.epochs,
                                                    batch_size=self.batch_size, lr=self.lr, seed=self.seed)}
                for count in self.per_owner(records)]

    def per_owner(self, records: Sequence[int]) -> list[int]:
        """Each owner's teachers, by its declared ``records`` (public)."""
        if isinstance(self.teachers, int):
            return declared_share(self.teachers, records)
        if len(self.teachers) != len(records):
            raise InvalidValue(f"{len(self.teachers)} teacher counts for {len(records)} gateways: give one per gateway")
        return list(self.teachers)


def float_tensor(values: np.ndarray) -> owner_pb2.Tensor:
    array = np.ascontiguousarray(values, dtype="<f4")
    return owner_pb2.Tensor(shape=list(array.shape), dtype="float32", data=array.tobytes())


def reading_message(reading: PublicReading) -> owner_pb2.PublicReading:
    return owner_pb2.PublicReading(columns=list(reading.columns or ()), fill=list(reading.fill or ()),
                                   image_size=list(reading.size or ()))


class GatewayVoteSource:
    """A ``SecureVoteSource`` over owners' gateways: admits the run at every gateway (``terms``,
    ``mechanism``, ``sigma``; at most ``rounds`` rounds of ``max_batch`` queries), then answers
    ``SecureLabeller``'s rounds. ``public_pool``: the public inputs the embedding is fitted on, at
    every gateway (None for teachers, which learn on the owners' records only). ``reading``: how
    each owner's data are read (the pool's columns and fill, or its image size).
    ``lifetime_epsilon``: a lower lifetime ε the run asks each owner to stay within (None: the
    owners' policies). ``embed``: the coordinator's own embedding of the pool, fitted on the pool
    alone as each gateway fits its own, in which a student picks what to ask. ``names``: the
    owners the gateways must describe themselves as, in order (None: any). A gateway that does not
    describe itself as such or admit the run is ``OwnerDropout`` naming it; the source is then
    shut down. ``admit_timeout_s``: how long admission may take (teachers train in it).
    ``input_shape``: the queries' shape where no pool is sent (teachers)."""

    num_actors = 0  # record-holding actors on the coordinator's side: none, they are the owners' business
    local = False  # ``actors.labeller.SecureVoteSource.local``: not owner-local kNN's secure-only votes

    def __init__(self, gateways: Sequence[OwnerGateway], verifier: Verifier, run: str,
                 terms: ClusterVotes | KnnVotes | TeacherVotes, mechanism: str, sigma: float, classes: Sequence[str],
                 public_pool: np.ndarray | None, max_batch: int, rounds: int, lifetime_epsilon: float | None = None,
                 round_timeout_s: float = 30.0, reading: PublicReading = PublicReading(),
                 embed: Embedding | None = None, names: Sequence[str] | None = None,
                 admit_timeout_s: float = 120.0, input_shape: Sequence[int] | None = None) -> None:
        if not gateways:
            raise InvalidValue("a gateway vote source needs at least one owner's gateway")
        if terms.takes_pool != (public_pool is not None):
            raise InvalidValue("give a public pool for the records' embedding, and none for teachers")
        self._verifier, self.run, self.terms = verifier, run, terms
        # the public inputs' shape (the queries'): the pool's, or as given where no pool goes (teachers)
        self.input_shape = tuple(input_shape) if input_shape is not None else tuple(np.shape(public_pool)[1:])
        self.embed = embed
        self.sigma, self.num_classes, self.round_timeout_s = sigma, len(classes), round_timeout_s
        self._round, self.rounds, self.max_batch = 0, rounds, max_batch  # the admitted plan's rounds
        # What ``actors.labeller`` reads: the record-level relation and why it holds, as the in-cluster
        # sources declare them, and what ``check_pairing`` compares with the mechanism's.
        self.neighbouring, self.neighbouring_lemma = Neighbouring.ADD_REMOVE, terms.lemma
        self.batch_coupled = terms.batch_coupled
        self.votes_per_record, self.sample_rate = terms.votes_per_record, terms.sample_rate
        self.gateways = GatewayRoster(gateways, round_timeout_s, names)
        self.owners = self.gateways.owners
        try:
            self._admit(mechanism, sigma, classes, public_pool, max_batch, rounds, lifetime_epsilon, reading,
                        admit_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _admit(self, mechanism: str, sigma: float, classes: Sequence[str], public_pool: np.ndarray | None,
               max_batch: int, rounds: int, lifetime_epsilon: float | None, reading: PublicReading,
               admit_timeout_s: float) -> None:
        run, terms = self.run, self.terms
        pool = float_tensor(public_pool) if public_pool is not None else None
        requests = [owner_pb2.AdmitRequest(run=run, mechanism=mechanism, sigma=sigma, max_batch=max_batch, rounds=rounds,
                                           lifetime_epsilon=lifetime_epsilon or 0.0, classes=list(classes),
                                           reading=reading_message(reading), public_pool=pool, **fields)
                    for fields in terms.admitted(self.gateways.declared)]
        self.admitted = self.gateways.each(lambda index, gateway: gateway.admit(requests[index], admit_timeout_s),
                                           "did not admit the run", admitting=True)
        # Every row of the teachers' histograms counts each of them once (the owners' signed cell bounds).
        self.votes_per_query = sum(int(a.cell_bound) for a in self.admitted) if terms.teachers_vote else None
        self.num_teachers = self.votes_per_query  # the owners' teachers in all (None: records vote)
        # Where each owner's votes are counted: behind its gateway, on its own Ray.
        self.placement = {owner: [gateway.endpoint] for owner, gateway in zip(self.owners, self.gateways.gateways)}
        log.info("run '%s' admitted by %s", run, ", ".join(f"{owner} (planned ε {a.planned_epsilon:.3g})"
                                                             for owner, a in zip(self.owners, self.admitted)))

    def ready(self, timeout: float = 2.0) -> bool:
        try:
            self.gateways.each(lambda index, gateway: gateway.describe(timeout), "is not reachable")
        except OwnerDropout:
            return False
        return True

    def noised_votes(self, inputs: np.ndarray, release: SkellamVotes, noise: NoisePolicy,
                     charge: Callable[[], None]) -> np.ndarray:
        """One secure round through the gateways (``SecureVoteSource.noised_votes``). The gateways
        draw their noise from their own OS entropy: ``noise`` is the coordinator's and unused."""
        if release.sigma != self.sigma:
            raise InvalidValue(f"the gateways admitted σ {self.sigma:g}; this round asks σ {release.sigma:g}")
        if self._round >= self.rounds:  # every gateway would refuse the round's keys: not "retry later"
            raise BudgetExceeded(f"the owners admitted run '{self.run}' for {self.rounds} round(s) of at most "
                                 f"{self.max_batch} queries, all used: nothing was asked, released or charged")
        inputs = np.ascontiguousarray(inputs, dtype=np.float32)
        self._round += 1
        round_, batch = self._round, len(inputs)
        deadline = time.monotonic() + self.round_timeout_s
        keys = self.gateways.each(lambda index, gateway: gateway.keys(self.run, round_, batch, time_left(deadline)),
                                  "sent no key for a secure vote round: the round is aborted; no share was asked, so "
                                  "nothing was released or charged", deadline=deadline)
        for owner, key in zip(self.owners, keys):
            self._check_key(owner, key, round_, batch)
        plan = release.plan(batch, self.num_classes, self.owners, [int(key.cell_bound) for key in keys])
        charge()
        request = owner_pb2.VotesRequest(run=self.run, round=round_, inputs=float_tensor(inputs), parties=keys)
        replies = self.gateways.each(lambda index, gateway: gateway.votes(request, time_left(deadline)),
                                     "sent no share of a secure vote round: the round is aborted; its shares were "
                                     "asked, so it was charged; nothing of it is decoded", deadline=deadline)
        shares = [_share(reply, plan.dimension) for reply in replies]
        return release.total(shares, plan, batch)

    def accounts(self, budget_sources: Mapping[str, str] | None = None) -> dict[str, GatewayAccount]:
        """Each owner's lifetime account as its gateway reports it now (``budget_sources``: where each
        owner's budget comes from, where the run knows it)."""
        return self.gateways.accounts(budget_sources)

    def shutdown(self) -> None:
        self.gateways.shutdown()

    def _check_key(self, owner: str, key: owner_pb2.SignedKey, round_: int, batch: int) -> None:
        signed = RoundKey(key.owner, key.public_key, key.cell_bound, key.run, key.round, key.batch, key.classes,
                          key.sigma)
        expected = (owner, self.run, round_, batch, self.num_classes, self.sigma)
        try:
            if (signed.owner, signed.run, signed.round, signed.batch, signed.classes, signed.sigma) != expected:
                raise ForgedKey(f"owner {owner}'s gateway signed a key for other terms than this round's")
            self._verifier.verify(signed, key.certificate, key.signature)
        except ForgedKey as err:
            raise OwnerDropout(f"{err}: the round is aborted; nothing was released or charged") from None


class GatewayRoster:
    """The owners' gateways one run asks, in order: each described on arrival (its owner's name and
    declared records, both public; ``names``: the owners they must be, None: any), its ledger's charges
    counted before the run, then every call made to all of them at once (``each``). A gateway that
    does not answer is ``OwnerDropout`` naming its owner, and the roster is shut down."""

    def __init__(self, gateways: Sequence[OwnerGateway], timeout_s: float, names: Sequence[str] | None = None) -> None:
        self.gateways, self.timeout_s = list(gateways), timeout_s
        self._pool = ThreadPoolExecutor(max_workers=len(self.gateways), thread_name_prefix="gateways")
        self.owners = tuple(gateway.endpoint for gateway in self.gateways)  # by name once described
        try:
            described = self.each(lambda index, gateway: gateway.describe(), "did not describe itself")
            self.owners = tuple(d.owner for d in described)
            if len(set(self.owners)) != len(self.owners):
                raise InvalidValue(f"the gateways name owners {list(self.owners)}: one gateway per owner")
            if names is not None and tuple(names) != self.owners:
                wrong = [f"the gateway at {gateway.endpoint} is owner {owner}, not {name}" for gateway, owner, name
                         in zip(self.gateways, self.owners, names) if owner != name] or [f"{len(names)} owners named"]
                raise OwnerDropout(f"{wrong[0]}: nothing was asked of any owner")
            self.declared = tuple(int(d.records) for d in described)
            budgets = self.each(lambda index, gateway: gateway.budget(), "did not report its budget", admitting=True)
            self.charges_before = {owner: int(reply.charges) for owner, reply in zip(self.owners, budgets)}
        except BaseException:
            self.shutdown()
            raise

    def each(self, call: Callable[[int, OwnerGateway], object], failure: str, deadline: float | None = None,
             admitting: bool = False) -> list:
        """``call(index, gateway)`` on every gateway in parallel, answers in order (by ``deadline``, the
        ``timeout_s`` after a round began, where there is one); the first owner's failure as
        ``gateway_failure`` says (``failure``: what it did not do)."""
        futures = [self._pool.submit(call, index, gateway) for index, gateway in enumerate(self.gateways)]
        answers = []
        for who, future in zip(self.owners, futures):
            try:
                answers.append(future.result(timeout=None if deadline is None else time_left(deadline)))
            except FutureTimeout:
                raise OwnerDropout(f"owner {who} {failure} (no answer within {self.timeout_s:g} s)") from None
            except grpc.RpcError as err:
                raise gateway_failure(who, failure, err, admitting) from None
        return answers

    def accounts(self, budget_sources: Mapping[str, str] | None = None,
                 charges_before: Mapping[str, int] | None = None) -> dict[str, GatewayAccount]:
        """Each owner's lifetime account as its gateway reports it now (``budget_sources``: where each
        owner's budget comes from, where the run knows it; ``charges_before``: each ledger's charges
        before the run began, where an earlier admitted run of it came first, else before this one's)."""
        replies = self.each(lambda index, gateway: gateway.budget(), "did not report its budget")
        before = charges_before or self.charges_before
        return {owner: account_of(reply, before[owner], (budget_sources or {}).get(owner))
                for owner, reply in zip(self.owners, replies)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for gateway in self.gateways:
            gateway.close()


def account_of(reply: owner_pb2.BudgetReply, charges_before: int, budget_source: str | None) -> GatewayAccount:
    """An owner's lifetime account from its gateway's ``Budget`` reply."""
    return GatewayAccount(reply.owner, reply.epsilon_limit, reply.delta, reply.epsilon_spent, int(reply.charges),
                          charges_before, budget_source)


def gateway_failure(who: str, failure: str, err: grpc.RpcError, admitting: bool = False) -> ConclaveError:
    """What a gateway's refusal means to the run, in one line naming the owner: its budget refusing
    (``BudgetExceeded``); while admitting, its policy or its ledger refusing the run (``OwnerRefused``);
    anything else, the owner dropping out of the run (``OwnerDropout``; ``failure``: what it did not do)."""
    code, line = err.code(), str(err.details() or "").strip()
    named = line if line.startswith(f"owner {who}") else f"owner {who}: {line}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BudgetExceeded(named)
    if admitting and code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
        return OwnerRefused(named)
    return OwnerDropout(f"owner {who} {failure}: {code.name}: {line}")


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic``), at least a millisecond: a call's timeout."""
    return max(0.001, deadline - time.monotonic())


def _share(reply: owner_pb2.VotesReply, dimension: int) -> np.ndarray:
    share = reply.share
    if share.dtype != "int64" or list(share.shape) != [dimension] or len(share.data) != 8 * dimension:
        raise OwnerDropout(f"a gateway sent a malformed share ({share.dtype} {list(share.shape)}): nothing is decoded")
    return np.frombuffer(share.data, dtype="<i8").copy()
