"""Vote runs at the owner's gateway: a run's vote source on the owner's own Ray, and its rounds.

``Admit`` starts the owner's records voting (the embedding fitted here on the public pool sent) or
teachers trained here on registered models (shards cut by a hash keyed from this machine's entropy:
no coordinator chooses which records share a teacher). ``Keys`` signs one round's X25519 key: a key
serves one round, keyed once. ``Votes`` checks every party's signed key, charges the owner's ledger a
charge computed HERE from the admitted σ and the source's own bound, counts (the actors' partials
summed: its own Ray is one trust domain), adds its Skellam noise share from OS entropy, masks, and
returns that one share.
"""
from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field

import grpc
import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from conclave.actors.cluster_votes import ClusterVoteSource
from conclave.actors.knn_votes import KnnVoteSource
from conclave.actors.owners import OwnerDataError, OwnerSource
from conclave.actors.teacher import OwnerShare, TeacherPool
from conclave.actors.vote_parties import RecordShare
from conclave.cluster.gateway.declaration import Declaration
from conclave.cluster.gateway.identity import ForgedKey, Identity, RoundKey, Verifier
from conclave.cluster.gateway.runs import OwnerRuns
from conclave.cluster.gateway.wire import (MAX_BATCH, MAX_ROUNDS, MAX_SEED, SHARE_DTYPE, Refused, check_run_name,
                                            decode_reading, decode_tensor)
from conclave.errors import first_line
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.learning.data.sources import DataSource, PublicReading
from conclave.learning.embeddings import EMBEDDINGS, fit_embedding
from conclave.learning.models import check_model
from conclave.learning.models.registry import REGISTRY as MODELS, ModelContractError
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import BudgetExceeded
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.noise import SECURE
from conclave.privacy.secure_sum import MaskKeys
from conclave.privacy.secure_votes import TEACHER_VOTES, SkellamVotes, VoteBound, cluster_votes, knn_votes
from conclave.protos import owner_pb2

log = logging.getLogger(__name__)

PIPELINE = "teacher_student"  # the pipeline vote labelling belongs to, as policies name it
# The mechanisms each vote source's rounds are answered by (registered names, as policies list them):
# for teachers, those whose secure variant is charged by one teacher's vote per query (TEACHER_VOTES).
MECHANISMS_OF = {"clusters": ("public-clusters",), "knn": ("private-knn",), "teachers": ("gnmax", "confident-gnmax")}
MAX_LR = 10.0
MAX_POOL = 200_000  # public inputs an embedding is fitted on


@dataclass
class AdmittedVotes:
    """One admitted vote run: its terms, the owner's vote source on its Ray, its ledger, its round keys."""

    run: str
    release: SkellamVotes
    mechanism: str
    max_batch: int
    rounds: int
    classes: int
    source: ClusterVoteSource | KnnVoteSource | TeacherPool
    cell_bound: int
    ledger: OwnerLedger
    votes_per_query: int | None  # teachers: every row of the owner's histogram counts each teacher once
    keys: dict[int, X25519PrivateKey] = field(default_factory=dict)  # keyed rounds whose key is unused
    last_keyed: int = 0

    def round_key(self, owner: str, round_: int, batch: int, public_key: bytes) -> RoundKey:
        """The key ``owner`` signs for ``round_`` of ``batch`` queries under the run's terms."""
        return RoundKey(owner, public_key, self.cell_bound, self.run, round_, batch, self.classes, self.release.sigma)

    def stop(self) -> None:
        self.keys.clear()
        self.source.shutdown()
        self.ledger.close()


class VoteRuns:
    """The vote runs of one owner (``declaration``): admitted through ``runs`` (its policy and ledger),
    keyed with its signing ``identity``, every party's key checked by the consortium CA's ``verifier``;
    each actor of its vote sources takes ``cpus_per_actor``. The caller holds the gateway's lock."""

    def __init__(self, declaration: Declaration, runs: OwnerRuns, identity: Identity, verifier: Verifier,
                 cpus_per_actor: float) -> None:
        self.declaration, self._runs = declaration, runs
        self._identity, self._verifier, self._cpus = identity, verifier, cpus_per_actor

    def admit(self, request: owner_pb2.AdmitRequest) -> owner_pb2.AdmitReply:
        """A vote run: its terms checked, its planned rounds admitted by the policy, its vote source
        started on the owner's Ray; nothing charged yet."""
        kind, release = self._checked_terms(request)
        self._runs.check_unseen(request.run, "rounds")
        pool = checked_pool(kind, request)
        data = self._runs.owner_data(decode_reading(request.reading))
        planned = record_charge(release, request.max_batch, request.mechanism).scaled(request.rounds)
        terms = self._runs.admitted_terms(request, planned, PIPELINE)  # the policy's checks: nothing changed yet
        self._runs.end_current(request.run)
        ledger = self._runs.open(terms, planned, request.run, record_charge(release, 1, request.mechanism))
        try:
            source = self._start_source(kind, request, pool, data)
        except OwnerDataError as err:  # its file as declared (missing, not its format, a column): no record
            ledger.close()
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, first_line(err)) from None
        except BaseException:
            ledger.close()
            raise
        cell_bound = int(sum(source.cell_bounds()))
        self._runs.admitted(AdmittedVotes(request.run, release, request.mechanism, request.max_batch, request.rounds,
                                          len(request.classes), source, cell_bound, ledger,
                                          cell_bound if kind == "teachers" else None))
        delta = self._runs.lifetime.delta
        epsilon = worst_case_guarantee(planned, delta).epsilon
        log.info("run '%s' admitted: %s votes, %s at σ %g, up to %d rounds of %d (planned ε %.4g)", request.run,
                 kind, request.mechanism, request.sigma, request.rounds, request.max_batch, epsilon)
        return owner_pb2.AdmitReply(run=request.run, planned_epsilon=epsilon, delta=delta, cell_bound=cell_bound)

    def key(self, request: owner_pb2.KeysRequest) -> owner_pb2.SignedKey:
        """A fresh X25519 key for one round, signed over the round's terms."""
        run = self._admitted(request.run)
        if request.round <= run.last_keyed:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {request.round} of run '{run.run}' is not after round {run.last_keyed}, "
                          "already keyed: a round is keyed once")
        if request.round > run.rounds:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"run '{run.run}' was admitted for {run.rounds} rounds, not round {request.round}")
        if not 1 <= request.batch <= run.max_batch:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"batch {request.batch} is outside the admitted [1, {run.max_batch}]")
        if not run.source.ready():  # asked again before the charge (votes): the coordinator charges once keyed
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"owner {self.declaration.name}'s actors cannot answer "
                                                       f"round {request.round} now: nothing was charged")
        private = X25519PrivateKey.generate()  # its rank is known once the round's parties are
        run.keys[request.round], run.last_keyed = private, request.round
        key = run.round_key(self.declaration.name, request.round, request.batch,
                            private.public_key().public_bytes_raw())
        return signed_round_key(key, self._identity.certificate_pem, self._identity.sign(key))

    def votes(self, request: owner_pb2.VotesRequest) -> owner_pb2.VotesReply:
        """One round's answer: its key used once, every party's key checked, the owner's ledger
        charged, then this owner's masked share of the round's noised votes."""
        run = self._admitted(request.run)
        private = run.keys.pop(request.round, None)  # one use, whatever follows
        if private is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {request.round} of run '{run.run}' holds no unused key of this gateway (not "
                          "keyed, or answered already): a key serves one round")
        inputs = decode_tensor(request.inputs, "inputs", tuple(run.source.input_shape))
        batch = len(inputs)
        rank, owners, bounds = self._checked_parties(run, request, private.public_key().public_bytes_raw(), batch)
        try:
            plan = run.release.plan(batch, run.classes, owners, bounds)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        if not run.source.ready():
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"owner {self.declaration.name}'s actors cannot answer "
                                                       f"round {request.round} now: nothing was charged")
        charge = record_charge(run.release, batch, run.mechanism)
        try:
            report = run.ledger.charge(charge, worst_case=charge)
        except BudgetExceeded as err:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released") from None
        # Charged: from here the round is a release. The clean sum stays in this process.
        votes = np.sum(run.source.partials(inputs), axis=0, dtype=np.int64)
        if run.votes_per_query is not None and (votes.sum(axis=1) != run.votes_per_query).any():
            # The charge holds for the whole ensemble's votes: a partial one is never answered.
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"not every teacher of owner {self.declaration.name} "
                                                       f"voted in round {request.round}: it was charged; "
                                                       "nothing was released")
        session = f"conclave/owner-round/{run.run}/{request.round}"
        masks = MaskKeys(rank, private).pairwise_masks([p.public_key for p in request.parties], session)
        share = run.release.share(votes, plan, owners, masks, SECURE.source(session))
        del votes, private, masks
        return owner_pb2.VotesReply(share=owner_pb2.Tensor(shape=[share.size], dtype=SHARE_DTYPE,
                                                            data=share.astype("<i8").tobytes()),
                                    epsilon_spent=report.epsilon_spent, charges=report.charges)

    def _checked_terms(self, request: owner_pb2.AdmitRequest) -> tuple[str, SkellamVotes]:
        """The vote source asked for and its rounds' release (σ and the source's own bound), or a refusal."""
        denied, invalid = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT
        check_run_name(request.run)
        kind = request.WhichOneof("vote_source")
        if kind is None:
            raise Refused(invalid, "name a vote source (clusters, knn or teachers) and its terms")
        if kind not in self.declaration.vote_sources:
            raise Refused(denied, f"owner {self.declaration.name} does not run {kind} votes")
        if request.mechanism not in MECHANISMS_OF[kind]:
            raise Refused(denied, f"mechanism {request.mechanism[:40]!r} is not registered for {kind} votes "
                                  f"({', '.join(MECHANISMS_OF[kind])})")
        bound = self._teachers_bound(request.teachers) if kind == "teachers" else self._records_bound(kind, request)
        if not (request.sigma > 0 and math.isfinite(request.sigma)):
            raise Refused(invalid, "sigma must be a positive finite number")
        if not 1 <= request.max_batch <= MAX_BATCH or not 1 <= request.rounds <= MAX_ROUNDS:
            raise Refused(invalid, f"max_batch must be in [1, {MAX_BATCH}] and rounds in [1, {MAX_ROUNDS}]")
        classes = list(request.classes)
        if len(classes) < 2 or len(set(classes)) != len(classes):
            raise Refused(invalid, "classes: at least two, distinct")
        if not (request.lifetime_epsilon >= 0 and math.isfinite(request.lifetime_epsilon)):
            raise Refused(invalid, "lifetime_epsilon must be a finite number >= 0 (0: the policy's)")
        return kind, SkellamVotes(request.sigma, bound)

    def _records_bound(self, kind: str, request: owner_pb2.AdmitRequest) -> VoteBound:
        """What one record moves when the records vote themselves (clusters or knn terms)."""
        denied, invalid = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT
        terms = request.clusters if kind == "clusters" else request.knn
        if terms.embedding not in EMBEDDINGS:
            raise Refused(denied, f"embedding {terms.embedding[:40]!r} is not registered ({', '.join(EMBEDDINGS)}): "
                                  "a gateway runs no code a coordinator names")
        if not terms.dims >= 1:
            raise Refused(invalid, f"{kind}.dims must be >= 1")
        if kind == "clusters":
            if not 1 <= terms.votes_per_record <= MAX_BATCH:
                raise Refused(invalid, f"clusters.votes_per_record must be in [1, {MAX_BATCH}]")
            return cluster_votes(int(terms.votes_per_record))
        if not 1 <= terms.k <= self.declaration.records:
            raise Refused(invalid, f"knn.k must be in [1, {self.declaration.records}] (the declared records)")
        if not 0 < terms.sample_rate <= 1:
            raise Refused(invalid, "knn.sample_rate must be in (0, 1]")
        return knn_votes(terms.sample_rate)

    def _teachers_bound(self, terms: owner_pb2.TeacherTerms) -> VoteBound:
        """Teachers' one vote per query, once their terms are within the registry and the owner's file."""
        invalid, declaration = grpc.StatusCode.INVALID_ARGUMENT, self.declaration
        if terms.model not in MODELS:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"model {terms.model[:40]!r} is not registered ({', '.join(MODELS.names)}): a gateway runs "
                          "no code a coordinator names")
        if not 1 <= terms.teachers <= declaration.teacher_limit:
            raise Refused(invalid, f"teachers.teachers must be in [1, {declaration.teacher_limit}] (owner "
                                   f"{declaration.name}'s limit)")
        if not 1 <= terms.epochs <= declaration.max_epochs:
            raise Refused(invalid, f"teachers.epochs must be in [1, {declaration.max_epochs}] (owner "
                                   f"{declaration.name}'s limit)")
        if not 1 <= terms.batch_size <= MAX_BATCH:
            raise Refused(invalid, f"teachers.batch_size must be in [1, {MAX_BATCH}]")
        if not 0 < terms.lr <= MAX_LR:
            raise Refused(invalid, f"teachers.lr must be in (0, {MAX_LR:g}]")
        if not 0 <= terms.seed <= MAX_SEED:
            raise Refused(invalid, f"teachers.seed must be in [0, {MAX_SEED}]")
        return TEACHER_VOTES

    def _start_source(self, kind: str, request: owner_pb2.AdmitRequest, pool: np.ndarray | None,
                      data: DataSource) -> ClusterVoteSource | KnnVoteSource | TeacherPool:
        """The owner's vote source on its own Ray over ``data``: its records, with the embedding fitted
        here on the public pool, or its teachers, trained here."""
        if kind == "teachers":
            return self._trained_teachers(request.teachers, tuple(request.classes), data,
                                          decode_reading(request.reading))
        declaration, terms = self.declaration, request.clusters if kind == "clusters" else request.knn
        embed = fit_embedding(terms.embedding, pool, int(terms.dims))
        owner = OwnerSource(declaration.name, data, declaration.actors, tuple(request.classes))
        share = RecordShare(owner, declaration.actors, declared=declaration.records)
        if kind == "clusters":
            source = ClusterVoteSource([share], embed, int(terms.votes_per_record), num_cpus_per_actor=self._cpus)
        else:
            source = KnnVoteSource([share], embed, int(terms.k), terms.sample_rate, num_cpus_per_actor=self._cpus,
                                   local=True)
        if tuple(source.input_shape) != pool.shape[1:]:
            source.shutdown()
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"public_pool: inputs of shape {list(pool.shape[1:])}; "
                                                            f"the owner's data are {list(source.input_shape)}")
        return source

    def _trained_teachers(self, terms: owner_pb2.TeacherTerms, classes: tuple[str, ...],
                          data: DataSource, reading: PublicReading) -> TeacherPool:
        """The owner's teachers trained on its Ray (its CPUs, or its GPUs where it has them). The shard
        hash is keyed from this machine's entropy, fresh for the run: a record's teacher is a function
        of the record alone, and the coordinator's seed chooses initialisation and batch order only.
        Each shard keeps at most its share of the declared records (``OwnerSource.records``)."""
        declaration = self.declaration
        owner = OwnerSource(declaration.name, data, int(terms.teachers), classes,
                            seed=secrets.randbits(126), records=declaration.records)
        train = TrainConfig(epochs=int(terms.epochs), batch_size=int(terms.batch_size), lr=terms.lr,
                            seed=int(terms.seed))
        teachers = TeacherPool([OwnerShare(owner, int(terms.teachers), declaration.actors)], terms.model, train,
                               num_cpus_per_actor=self._cpus)
        try:
            if reading.columns and tuple(teachers.input_shape) != (len(reading.columns),):
                raise OwnerDataError(f"owner {declaration.name}: its records are inputs {list(teachers.input_shape)}, "
                                     f"but the run's are the public pool's {len(reading.columns)} columns")
            check_model(terms.model, teachers.num_classes, tuple(teachers.input_shape))
            teachers.train(progress=False)
        except ModelContractError as err:
            teachers.shutdown()
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"teachers.model: {err}".splitlines()[0]) from None
        except BaseException:
            teachers.shutdown()
            raise
        # No time in the log: it grows with the records each teacher holds.
        log.info("owner %s: %d teachers trained", declaration.name, teachers.num_teachers)
        return teachers

    def _admitted(self, run: str) -> AdmittedVotes:
        current = self._runs.current
        if current is None or current.run != run:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is not admitted by this gateway")
        if not isinstance(current, AdmittedVotes):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is a DP-SGD run: it takes steps, "
                                                             "not votes")
        return current

    def _checked_parties(self, run: AdmittedVotes, request: owner_pb2.VotesRequest, public_key: bytes,
                         batch: int) -> tuple[int, tuple[str, ...], list[int]]:
        """This gateway's rank, the owners in rank order and their signed cell bounds, once every
        party's key verifies for this very round, from this gateway itself or a declared peer."""
        denied = grpc.StatusCode.PERMISSION_DENIED
        if len(request.parties) > len(self.declaration.parties):
            raise Refused(denied, f"{len(request.parties)} parties, but owner {self.declaration.name} and its declared "
                                  f"peers are {len(self.declaration.parties)}")
        mine = run.round_key(self.declaration.name, request.round, batch, public_key)
        rank = None
        for index, party in enumerate(request.parties):
            if party.owner not in self.declaration.parties:
                raise Refused(denied, f"party {party.owner[:40]!r} is not a declared peer of owner "
                                      f"{self.declaration.name}")
            key = RoundKey(party.owner, party.public_key, party.cell_bound, party.run, party.round, party.batch,
                           party.classes, party.sigma)
            try:
                self._verifier.verify(key, party.certificate, party.signature)
            except ForgedKey as err:
                raise Refused(denied, str(err)) from None
            terms = (key.run, key.round, key.batch, key.classes, key.sigma)
            if terms != (mine.run, mine.round, mine.batch, mine.classes, mine.sigma):
                raise Refused(denied, f"owner {party.owner}'s key is for another round or other terms "
                                      f"(run, round, batch, classes, σ) than this one")
            if party.owner == self.declaration.name:
                if key != mine:
                    raise Refused(denied, f"the key given as owner {self.declaration.name}'s is not the one this "
                                          f"gateway made for round {request.round}")
                rank = index
        owners = tuple(party.owner for party in request.parties)
        if len(set(owners)) != len(owners):
            raise Refused(denied, f"the parties {list(owners)} name an owner twice")
        if rank is None:
            raise Refused(denied, f"owner {self.declaration.name} is not among the round's parties")
        return rank, owners, [int(party.cell_bound) for party in request.parties]


def checked_pool(kind: str, request: owner_pb2.AdmitRequest) -> np.ndarray | None:
    """The public pool the records' embedding is fitted on; teachers take none."""
    if kind == "teachers":
        if request.HasField("public_pool"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "public_pool: teachers learn on the owner's records "
                                                            "only; send none")
        return None
    pool = decode_tensor(request.public_pool, "public_pool")
    if len(pool) > MAX_POOL:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"public_pool: at most {MAX_POOL} inputs")
    return pool


def record_charge(release: SkellamVotes, count: int, label: str) -> PrivacyCharge:
    """What ``count`` queries of a round cost on the owner's records, as ``actors.labeller`` restates
    it for a teacher pool: teachers' one-vote charge holds for add/remove neighbours of the records
    by the shard lemma (a record changes one shard, one teacher); the records' own bounds are
    record-level already. The owner's ledger composes its policy's relation only, so a policy for
    any other relation refuses the run (``OwnerLedger.open``)."""
    charge = release.charge(count, label)
    if charge.neighbouring == Neighbouring.ONE_VOTE:
        return charge.for_records(Neighbouring.ADD_REMOVE, SHARD_LEMMA)
    return charge


def signed_round_key(key: RoundKey, certificate_pem: bytes, signature: bytes) -> owner_pb2.SignedKey:
    return owner_pb2.SignedKey(owner=key.owner, certificate=certificate_pem, public_key=key.public_key,
                               cell_bound=key.cell_bound, run=key.run, round=key.round, batch=key.batch,
                               classes=key.classes, sigma=key.sigma, signature=signature)
