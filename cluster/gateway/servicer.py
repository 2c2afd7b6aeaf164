"""The owner's gateway: the Owner service over the owner's own Ray, its policy and its ledger.

A coordinator reaches the owner only through these calls (``protos/owner.proto``). ``Admit`` checks
a run's terms against the owner's policy (``OwnerAdmission.admit``: mechanisms, the per-run ceiling,
the lifetime ε asked) and starts the owner's vote source on its own Ray: its records voting, with
the embedding fitted here on the public pool the request carries, or teachers trained here on
registered models (shards cut by a hash keyed from this machine's entropy, so no coordinator can
choose which records share a teacher). ``Keys`` makes and signs one round's X25519 key;
``Votes`` checks every party's signed key, charges the owner's ledger with a charge computed HERE
from the admitted σ and the vote source's own bound, then counts (the gateway's actors' partials
summed: its own Ray is one trust domain), adds its Skellam noise share from OS entropy, masks, and
returns that one share. A key serves one round: a second Votes, a replayed round or a second Keys
for a round is refused. Every refusal is one line with a gRPC status, and nothing is charged.

``Admit`` with DP-SGD terms plans the run's secure sum from public numbers and admits its whole
schedule; each ``Step`` (keyed by ``Keys`` as a round is) is charged one step, then answers with the
masked share of the owner's noised clipped gradient sum (``cluster.gateway.steps``). A sparse
fine-tuning's terms bring the public pre-trained weights and the public mask of the entries that
train: its steps send those entries' values only, and its sum is over them alone. With NearPrivate's
terms, the two rounds after the steps are its releases, each charged, then answered by ``NearPrivate``
with one masked share (``cluster.gateway.near_private``).

One run at a time: admitting a new run ends the previous one (its actors stop, its ledger closes).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from conclave.actors.cluster_votes import ClusterVoteSource
from conclave.actors.knn_votes import KnnVoteSource
from conclave.actors.owners import OwnerDataError, OwnerSource
from conclave.actors.teacher import OwnerShare, TeacherPool
from conclave.actors.vote_parties import RecordShare
from conclave.cluster.gateway.declaration import Declaration
from conclave.cluster.gateway.identity import ForgedKey, Identity, RoundKey, StepKey, Verifier
from conclave.cluster.gateway.near_private import COUNTS, PCA, NearPrivateReleases
from conclave.cluster.gateway.steps import (DPSGD, DPSGD_PIPELINE, SPARSE_PIPELINE, AdmittedSteps, StepTerms,
                                             schedule_charge, signed_step_key, step_key_of)
from conclave.cluster.gateway.wire import (MAX_BATCH, MAX_ROUNDS, MAX_SEED, SHARE_DTYPE, Refused, check_run_name,
                                            decode_arguments, decode_reading, decode_standardiser, decode_tensor,
                                            decode_trained, decode_vector, decode_weights)
from conclave.errors import first_line
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.learning.data.schema import Standardiser
from conclave.learning.data.sources import DataSource, PublicReading
from conclave.learning.embeddings import EMBEDDINGS, fit_embedding
from conclave.learning.models import build_model, check_model
from conclave.learning.owner_step import OwnerEmbeddings, OwnerSteps, load_parameters
from conclave.learning.secure_dpsgd import SecureAggregation
from conclave.learning.models.registry import REGISTRY as MODELS, ModelContractError
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import BudgetExceeded, LedgerDamaged, LedgerInUse, read_ledger
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.accounting.owner_policy import (
    OwnerAdmission, OwnerBudget, OwnerPolicy, OwnerRefused, RunRequest,
)
from conclave.privacy.accounting.rdp import epsilon_from_rdp, sum_charges
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
MAX_CLIP = 1e6  # the largest clip bound a DP-SGD run may ask
MAX_RECORDS = 10**12  # the most records a DP-SGD run may declare, all owners together
MAX_PARAMETERS = 16 * 2**20  # a model's weights travel in one message (64 MiB of float32): no larger model is built


@dataclass
class AdmittedRun:
    """One admitted run: its terms, the owner's vote source on its Ray, its ledger, its round keys."""

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

    def stop(self) -> None:
        self.keys.clear()
        self.source.shutdown()
        self.ledger.close()


class OwnerServicer:
    """The Owner service's calls for one owner (``declaration``), its policy on this machine, its
    signing ``identity`` and the consortium CA's ``verifier``. Ray must be running (the owner's).

    ``asked``: the budget that a run which started this gateway itself, on the owner's machine
    (``cluster.gateway.local``), declares for the owner: the budget where no policy is written here
    (``policy`` None), else a request for less that the policy checks (never more, nor another ledger
    folder). None: the policy alone decides, and there must be one."""

    def __init__(self, declaration: Declaration, policy: OwnerPolicy | None, identity: Identity, verifier: Verifier,
                 cpus_per_actor: float = 1.0, asked: OwnerBudget | None = None) -> None:
        if policy is None and asked is None:
            raise OwnerRefused(f"owner {declaration.name} has no policy on this machine")
        self.declaration, self.policy, self._asked = declaration, policy, asked
        self._identity, self._verifier, self._cpus = identity, verifier, cpus_per_actor
        self._lock = threading.Lock()  # one call changes the state at a time
        self._run: AdmittedRun | AdmittedSteps | None = None
        self._seen_runs: set[str] = set()

    # --- the calls ------------------------------------------------------------------------

    @property
    def lifetime(self) -> OwnerBudget:
        """The lifetime budget in force: the policy's, else the one the run that started this gateway declares."""
        return self.policy.budget() if self.policy is not None else self._asked

    def describe(self, request: owner_pb2.DescribeRequest) -> owner_pb2.Description:
        declaration, policy, lifetime = self.declaration, self.policy, self.lifetime
        mechanisms, ceiling = (policy.mechanisms, policy.max_run_epsilon) if policy is not None else ((), None)
        return owner_pb2.Description(owner=declaration.name, records=declaration.records,
                                     vote_sources=list(declaration.vote_sources), mechanisms=list(mechanisms),
                                     max_run_epsilon=ceiling or 0.0, epsilon=lifetime.epsilon, delta=lifetime.delta)

    def admit(self, request: owner_pb2.AdmitRequest) -> owner_pb2.AdmitReply:
        with self._lock:
            if request.WhichOneof("vote_source") == "dpsgd":
                return self._admit_steps(request)
            kind, release = self._checked_terms(request)
            if request.run in self._seen_runs:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"run '{request.run[:40]}' was admitted before: a run's rounds are never replayed")
            pool = self._checked_pool(kind, request)
            data = self._owner_data(decode_reading(request.reading))
            planned = record_charge(release, request.max_batch, request.mechanism).scaled(request.rounds)
            ledger = self._admitting_ledger(request, planned)  # the policy's checks: nothing changed yet
            if self._run is not None:
                log.info("run '%s' ends: run '%s' is admitted", self._run.run, request.run)
                self._run.stop()
                self._run = None
            try:
                self._open(ledger, planned, request.run, record_charge(release, 1, request.mechanism))
                source = self._start_source(kind, request, pool, data)
            except OwnerDataError as err:  # its file as declared (missing, not its format, a column): no record
                ledger.close()
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, first_line(err)) from None
            except BaseException:
                ledger.close()
                raise
            cell_bound = int(sum(source.cell_bounds()))
            self._run = AdmittedRun(request.run, release, request.mechanism, request.max_batch, request.rounds,
                                    len(request.classes), source, cell_bound, ledger,
                                    cell_bound if kind == "teachers" else None)
            self._seen_runs.add(request.run)
            epsilon = worst_case_guarantee(planned, self.lifetime.delta).epsilon
            log.info("run '%s' admitted: %s votes, %s at σ %g, up to %d rounds of %d (planned ε %.4g)", request.run,
                     kind, request.mechanism, request.sigma, request.rounds, request.max_batch, epsilon)
            return owner_pb2.AdmitReply(run=request.run, planned_epsilon=epsilon, delta=self.lifetime.delta,
                                        cell_bound=cell_bound)

    def keys(self, request: owner_pb2.KeysRequest) -> owner_pb2.SignedKey:
        with self._lock:
            if isinstance(self._run, AdmittedSteps) and self._run.run == request.run:
                return self._step_key(request)
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
            private = X25519PrivateKey.generate()  # its rank is known once the round's parties are
            run.keys[request.round], run.last_keyed = private, request.round
            key = self._round_key(run, request.round, request.batch, private.public_key().public_bytes_raw())
            return signed(key, self._identity.certificate_pem, self._identity.sign(key))

    def votes(self, request: owner_pb2.VotesRequest) -> owner_pb2.VotesReply:
        with self._lock:
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

    def budget(self, request: owner_pb2.BudgetRequest) -> owner_pb2.BudgetReply:
        owner, lifetime = self.declaration.name, self.lifetime
        reply = owner_pb2.BudgetReply(owner=owner, epsilon_limit=lifetime.epsilon, delta=lifetime.delta)
        path = lifetime.ledger_path(owner)
        if path.exists():
            try:
                snapshot = read_ledger(path)
            except LedgerDamaged as err:  # its owner's to repair; the line names the ledger and what is wrong
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err).splitlines()[0]) from None
            spent = snapshot.spent
            reply.epsilon_spent = epsilon_from_rdp(spent.orders, spent.rdp, snapshot.delta)[0] if snapshot.charges else 0.0
            reply.charges = snapshot.charges
        return reply

    def stop(self) -> None:
        with self._lock:
            if self._run is not None:
                self._run.stop()
                self._run = None

    # --- checks ---------------------------------------------------------------------------

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

    @staticmethod
    def _checked_pool(kind: str, request: owner_pb2.AdmitRequest) -> np.ndarray | None:
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

    def _admitting_ledger(self, request: owner_pb2.AdmitRequest, planned: PrivacyCharge,
                          pipeline: str = PIPELINE, releases: tuple[str, ...] = ()) -> OwnerLedger:
        """The owner's ledger for the run, once its policy (else the budget ``asked`` at the start) admits
        the run as asked (refused otherwise). The policy is read again: the owner may have changed it
        (``conclave owner raise``) meanwhile."""
        owner = self.declaration.name
        try:
            policy = OwnerPolicy.load(owner)
        except OwnerRefused as err:  # unreadable
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        if policy is None and self._asked is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"owner {owner} has no policy on its machine any more: "
                                                             "it admits no run")
        self.policy = policy
        lifetime = self.lifetime
        if planned.neighbouring != lifetime.neighbouring:  # as ``OwnerLedger.open`` refuses, before anything ends
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"owner {owner}: its budget is for {lifetime.neighbouring} neighbours; these releases' "
                          f"charges hold for {planned.neighbouring} neighbours of its records")
        asked = self._asked
        if request.lifetime_epsilon:  # the lifetime ε the run asks to stay within, checked as a budget asked
            asked = dataclasses.replace(asked if asked is not None else lifetime, epsilon=request.lifetime_epsilon)
        data = (self.declaration.data.path,) if self.declaration.data.path else ()
        try:
            terms = OwnerAdmission(owner, asked, data).admit(
                RunRequest(request.run, pipeline, (request.mechanism, *releases)), planned)
        except OwnerRefused as err:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        return OwnerLedger(terms, data)  # a policy or the budget asked is in force: terms, never None

    @staticmethod
    def _open(ledger: OwnerLedger, planned: PrivacyCharge, run: str, first: PrivacyCharge) -> None:
        """Open the run's ledger, which must pay for ``first`` (the least the run releases: one round of one
        query, or a DP-SGD run's whole schedule) before anything starts or trains: refused otherwise, the
        ledger closed and nothing charged."""
        try:
            ledger.open(planned, run)
        except OwnerRefused as err:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        except (LedgerInUse, LedgerDamaged) as err:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err).splitlines()[0]) from None
        refused = ledger.refusal(first)
        if refused is not None:
            ledger.close()
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{refused}; nothing was admitted or charged")

    def _owner_data(self, reading: PublicReading) -> DataSource:
        """The owner's data as the run reads them (by the pool's columns, at its size): a string
        operation, no file opened; an owner's file that names other columns or another size is refused."""
        try:
            return self.declaration.data.read_as(reading)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"owner {self.declaration.name}: {err}") from None

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

    def _admitted(self, run: str) -> AdmittedRun:
        if self._run is None or self._run.run != run:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is not admitted by this gateway")
        if not isinstance(self._run, AdmittedRun):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is a DP-SGD run: it takes steps, "
                                                             "not votes")
        return self._run

    def _round_key(self, run: AdmittedRun, round_: int, batch: int, public_key: bytes) -> RoundKey:
        return RoundKey(self.declaration.name, public_key, run.cell_bound, run.run, round_, batch, run.classes,
                        run.release.sigma)

    def _checked_parties(self, run: AdmittedRun, request: owner_pb2.VotesRequest, public_key: bytes,
                         batch: int) -> tuple[int, tuple[str, ...], list[int]]:
        """This gateway's rank, the owners in rank order and their signed cell bounds, once every
        party's key verifies for this very round, from this gateway itself or a declared peer."""
        denied = grpc.StatusCode.PERMISSION_DENIED
        if len(request.parties) > len(self.declaration.parties):
            raise Refused(denied, f"{len(request.parties)} parties, but owner {self.declaration.name} and its declared "
                                  f"peers are {len(self.declaration.parties)}")
        mine = self._round_key(run, request.round, batch, public_key)
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

    # --- DP-SGD steps (``cluster.gateway.steps``) -----------------------------------------

    def step(self, request: owner_pb2.StepRequest) -> owner_pb2.StepReply:
        with self._lock:
            run = self._admitted_steps(request.run)
            if not 1 <= request.round <= run.terms.steps:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              f"run '{run.run}' was admitted for {run.terms.steps} steps, not step {request.round}")
            private = run.keys.pop(request.round, None)  # one use, whatever follows
            if private is None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {request.round} of run '{run.run}' holds no unused key of this gateway (not "
                              "keyed, or answered already): a key serves one step")
            sent = self._sent_weights(run, request)
            mine = run.step_key(self.declaration.name, self.declaration.records, request.round,
                                private.public_key().public_bytes_raw())
            rank = self._checked_step_parties(run, request, mine)
            charge = run.terms.step_charge
            try:
                report = run.ledger.charge(charge, worst_case=charge)
            except BudgetExceeded as err:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released") from None
            # Charged: from here the step is a release. The clean sum stays inside ``share``.
            share = run.share(sent, request.round, rank, private, [p.public_key for p in request.parties])
            del private
            return owner_pb2.StepReply(share=owner_pb2.Tensor(shape=[share.size], dtype=SHARE_DTYPE,
                                                               data=share.astype("<i8").tobytes()),
                                       epsilon_spent=report.epsilon_spent, charges=report.charges)

    @staticmethod
    def _sent_weights(run: AdmittedSteps, request: owner_pb2.StepRequest) -> list[np.ndarray] | np.ndarray:
        """A step's weights: every parameter, or in a sparse run the trained entries' values [d] alone."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if run.terms.sparse:
            if request.weights:
                raise Refused(invalid, "weights: a sparse run's step sends its trained entries' values (trained), "
                                       "the rest being the admitted pre-trained weights")
            return decode_vector(request.trained, "trained", run.terms.plan.dimension)
        if request.HasField("trained"):
            raise Refused(invalid, "trained: only a sparse run's steps send trained entries; send every weight")
        return decode_weights(request.weights, run.owner_steps.shapes)

    def _admit_steps(self, request: owner_pb2.AdmitRequest) -> owner_pb2.AdmitReply:
        """A DP-SGD run: its terms checked, its whole schedule admitted by the policy, its secure sum
        planned on the registered model's trainable entries; nothing charged yet."""
        terms, classes, near_private = self._checked_step_terms(request)
        if request.run in self._seen_runs:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"run '{request.run[:40]}' was admitted before: a run's steps are never replayed")
        declaration = self.declaration
        data = self._owner_data(decode_reading(request.reading))  # a table in the pool's columns and fill
        planned = schedule_charge(terms.sample_rate, terms.noise_multiplier, int(terms.steps))
        releases: tuple[str, ...] = ()
        if near_private is not None:  # the whole run: the steps, then both releases
            planned = sum_charges([planned, *near_private.charges], label="planned")
            releases = tuple(charge.label for charge in near_private.charges)
        sparse = terms.HasField("sparse")
        # the policy's checks: nothing changed yet
        ledger = self._admitting_ledger(request, planned, SPARSE_PIPELINE if sparse else DPSGD_PIPELINE, releases)
        try:
            try:
                dataset, _ = data.read_private(classes, name=declaration.name)  # what was dropped stays here
            except (OSError, ValueError) as err:  # its file as declared (missing, not its format, a column): no record
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"owner {declaration.name}: {first_line(err)}") from None
            input_shape = tuple(dataset.x.shape[1:])
            standardiser = decode_standardiser(terms, input_shape)
            arguments = decode_arguments(terms)
            shapes = self._model_shapes(terms.model, len(classes), input_shape, standardiser, arguments)
            pretrained, trained = None, None
            if sparse:  # checked against the model's shapes before it is built
                pretrained = decode_weights(terms.sparse.pretrained, shapes, "sparse.pretrained")
                trained = decode_trained(terms.sparse, shapes)
            try:
                check_model(terms.model, len(classes), input_shape, standardiser=standardiser, **arguments)
            except ModelContractError as err:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"dpsgd.model: {err}".splitlines()[0]) from None
            model = build_model(terms.model, len(classes), input_shape=input_shape, seed=int(terms.seed),
                                standardiser=standardiser, **arguments)
            if pretrained is not None:  # the frozen entries' values for the whole run
                load_parameters(model, pretrained)
            owner_steps = OwnerSteps(model, dataset.x, dataset.y, terms.sample_rate, int(terms.steps),
                                     declaration.records, terms.max_grad_norm, trained)
            embeddings = None
            if near_private is not None:  # its own copy of the model: the steps' stays theirs
                embeddings = OwnerEmbeddings(build_model(terms.model, len(classes), input_shape=input_shape,
                                                         seed=int(terms.seed), standardiser=standardiser, **arguments),
                                             dataset.x, declaration.records)
            del dataset
            try:
                plan = SecureAggregation(tuple(terms.parties), owner_steps.dimension).plan(
                    terms.max_grad_norm, terms.noise_multiplier, int(terms.records), int(terms.steps))
            except ValueError as err:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err).splitlines()[0]) from None
            step_terms = StepTerms(terms.model, terms.max_grad_norm, terms.noise_multiplier, terms.sample_rate,
                                   int(terms.steps), tuple(terms.parties), int(terms.records), plan, sparse)
            if near_private is not None:
                try:  # the covariance's plan is fixed now: refused here rather than after the steps
                    near_private.plan(PCA, embeddings.dimension, step_terms.parties, step_terms.records)
                except ValueError as err:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err).splitlines()[0]) from None
            if self._run is not None:
                log.info("run '%s' ends: run '%s' is admitted", self._run.run, request.run)
                self._run.stop()
                self._run = None
            self._open(ledger, planned, request.run, planned)
        except BaseException:
            ledger.close()
            raise
        self._run = AdmittedSteps(request.run, step_terms, owner_steps, ledger, near_private, embeddings)
        self._seen_runs.add(request.run)
        epsilon = worst_case_guarantee(planned, self.lifetime.delta).epsilon
        log.info("run '%s' admitted: %s on %s (d = %d), clip %g, z %g, q %g, up to %d steps%s (planned ε %.4g)",
                 request.run, "sparse DP fine-tuning" if sparse else "DP-SGD", terms.model, plan.dimension,
                 terms.max_grad_norm, terms.noise_multiplier, terms.sample_rate, terms.steps,
                 ", then NearPrivate" if near_private else "", epsilon)
        return owner_pb2.AdmitReply(run=request.run, planned_epsilon=epsilon, delta=self.lifetime.delta,
                                    cell_bound=declaration.records)

    def _checked_step_terms(self, request: owner_pb2.AdmitRequest
                            ) -> tuple[owner_pb2.DpsgdTerms, tuple[str, ...], NearPrivateReleases | None]:
        """The DP-SGD terms, the classes and NearPrivate's releases (None: not asked), within the
        registry and the protocol's bounds, or a refusal."""
        denied, invalid = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT
        check_run_name(request.run)
        terms, name = request.dpsgd, self.declaration.name
        if request.mechanism != DPSGD:
            raise Refused(denied, f"mechanism {request.mechanism[:40]!r}: DP-SGD terms release through '{DPSGD}'")
        if terms.model not in MODELS:
            raise Refused(denied, f"model {terms.model[:40]!r} is not registered ({', '.join(MODELS.names)}): a "
                                  "gateway runs no code a coordinator names")
        if not (0 < terms.max_grad_norm <= MAX_CLIP):
            raise Refused(invalid, f"dpsgd.max_grad_norm must be in (0, {MAX_CLIP:g}]")
        if not (terms.noise_multiplier > 0 and math.isfinite(terms.noise_multiplier)):
            raise Refused(invalid, "dpsgd.noise_multiplier must be a positive finite number")
        if not 0 < terms.sample_rate <= 1:
            raise Refused(invalid, "dpsgd.sample_rate must be in (0, 1]")
        if not 1 <= terms.steps <= MAX_ROUNDS:
            raise Refused(invalid, f"dpsgd.steps must be in [1, {MAX_ROUNDS}]")
        if not 0 <= terms.seed <= MAX_SEED:
            raise Refused(invalid, f"dpsgd.seed must be in [0, {MAX_SEED}]")
        parties = list(terms.parties)
        if name not in parties or len(set(parties)) != len(parties):
            raise Refused(invalid, f"dpsgd.parties must name each owner once, owner {name} among them")
        strangers = [p for p in parties if p not in self.declaration.parties]
        if strangers:
            raise Refused(denied, f"party {strangers[0][:40]!r} is not a declared peer of owner {name}")
        if not self.declaration.records <= terms.records <= MAX_RECORDS:
            raise Refused(invalid, f"dpsgd.records (the run's declared records) must be in "
                                   f"[{self.declaration.records}, {MAX_RECORDS}]: owner {name} alone declares "
                                   f"{self.declaration.records}")
        classes = tuple(request.classes)
        if len(classes) < 2 or len(set(classes)) != len(classes):
            raise Refused(invalid, "classes: at least two, distinct")
        if not (request.lifetime_epsilon >= 0 and math.isfinite(request.lifetime_epsilon)):
            raise Refused(invalid, "lifetime_epsilon must be a finite number >= 0 (0: the policy's)")
        if request.HasField("public_pool"):
            raise Refused(invalid, "public_pool: DP-SGD learns on the owner's records only; send none")
        near_private = None
        if terms.HasField("near_private") and terms.HasField("sparse"):
            raise Refused(invalid, "near_private: NearPrivate's releases go with active learning's DP-SGD, not with "
                                   "a sparse fine-tuning")
        if terms.HasField("near_private"):
            try:
                near_private = NearPrivateReleases.of(terms.near_private)
            except ValueError as err:
                raise Refused(invalid, str(err)) from None
        return terms, classes, near_private

    @staticmethod
    def _model_shapes(model: str, classes: int, input_shape: tuple[int, ...], standardiser: Standardiser | None,
                      arguments: dict[str, int | float]) -> tuple[tuple[int, ...], ...]:
        """The registered model's parameter shapes, worked out without memory (on torch's meta device);
        refused when its weights could not travel in one message."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        try:
            with torch.device("meta"):
                shapes = tuple(tuple(p.shape) for p in build_model(model, classes, input_shape=input_shape,
                                                                   standardiser=standardiser, **arguments).parameters())
        except Exception as err:  # noqa: BLE001 - a factory given other arguments may raise anything: one line
            raise Refused(invalid, f"dpsgd.model: {model} cannot be built with {arguments or 'no arguments'}: "
                                   f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
        if sum(math.prod(shape) for shape in shapes) > MAX_PARAMETERS:
            raise Refused(invalid, f"dpsgd.model: {model} with {arguments or 'no arguments'} has more than "
                                   f"{MAX_PARAMETERS} parameters, more than a step's weights can carry")
        return shapes

    def _admitted_steps(self, run: str) -> AdmittedSteps:
        if self._run is None or self._run.run != run:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is not admitted by this gateway")
        if not isinstance(self._run, AdmittedSteps):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is not a DP-SGD run: it takes votes, "
                                                             "not steps")
        return self._run

    def _step_key(self, request: owner_pb2.KeysRequest) -> owner_pb2.SignedKey:
        """A fresh X25519 key for one step, signed over the step's plan terms (batch 1: one vector)."""
        run = self._admitted_steps(request.run)
        if request.round <= run.last_keyed:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"step {request.round} of run '{run.run}' is not after step {run.last_keyed}, already "
                          "keyed: a step is keyed once")
        if request.round > run.terms.steps:
            self._plan_release(run, request)
        elif request.batch != 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"batch {request.batch}: a DP-SGD step releases one "
                                                            "vector; key it with batch 1")
        private = X25519PrivateKey.generate()
        run.keys[request.round], run.last_keyed = private, request.round
        key = run.step_key(self.declaration.name, self.declaration.records, request.round,
                           private.public_key().public_bytes_raw())
        return signed_step_key(key, self._identity.certificate_pem, self._identity.sign(key))

    def _plan_release(self, run: AdmittedSteps, request: owner_pb2.KeysRequest) -> None:
        """A NearPrivate round's plan, kept for its key and share (refused: not a round of this run)."""
        terms = run.terms
        kind = NearPrivateReleases.kind(request.round, terms.steps) if run.near_private else None
        if kind is None:
            after = " and NearPrivate's two releases" if run.near_private else ""
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run.run}' was admitted for {terms.steps} "
                                                             f"steps{after}, not round {request.round}")
        if kind == PCA and request.batch != 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"batch {request.batch}: the DP-PCA covariance is one "
                                                            "release; key it with batch 1")
        if kind == COUNTS and not 1 <= request.batch <= MAX_BATCH:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"batch {request.batch}: the support counts are for 1 to {MAX_BATCH} public points")
        size = run.embeddings.dimension if kind == PCA else int(request.batch)
        try:
            run.release_plans[request.round] = run.near_private.plan(kind, size, terms.parties, terms.records)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err).splitlines()[0]) from None

    def near_private(self, request: owner_pb2.NearPrivateRequest) -> owner_pb2.StepReply:
        """One of NearPrivate's releases: its key used once, every party's key checked, the owner's
        ledger charged, then this owner's masked share under the checkpoint's weights."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        with self._lock:
            run = self._admitted_steps(request.run)
            kind = NearPrivateReleases.kind(request.round, run.terms.steps) if run.near_private else None
            if kind is None:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"round {request.round} of run '{run.run}' is not "
                                                                 "one of NearPrivate's releases it was admitted for")
            private = run.keys.pop(request.round, None)  # one use, whatever follows
            if private is None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"round {request.round} of run '{run.run}' holds no unused key of this gateway (not "
                              "keyed, or answered already): a key serves one release")
            weights = decode_weights(request.weights, run.owner_steps.shapes)
            support = None
            if kind == COUNTS:
                d, k = run.embeddings.dimension, run.release_plans[request.round].dimension
                projection = decode_tensor(request.projection, "projection")
                if projection.ndim != 2 or projection.shape[0] != d or projection.shape[1] > d:
                    raise Refused(invalid, f"projection: shape {list(projection.shape)} is not [{d}, p] with p <= {d}")
                points = decode_tensor(request.public_points, "public_points", (projection.shape[1],))
                if len(points) != k:
                    raise Refused(invalid, f"public_points: {len(points)} rows, but the round was keyed for {k}")
                if not math.isfinite(request.threshold):
                    raise Refused(invalid, "threshold must be a finite number")
                support = (projection.astype(np.float64), points.astype(np.float64), float(request.threshold))
            elif request.HasField("projection") or request.HasField("public_points"):
                raise Refused(invalid, "the DP-PCA covariance takes weights only: send no projection or points")
            mine = run.step_key(self.declaration.name, self.declaration.records, request.round,
                                private.public_key().public_bytes_raw())
            rank = self._checked_step_parties(run, request, mine)
            charge = run.near_private.release(kind).charge()
            try:
                report = run.ledger.charge(charge, worst_case=charge)
            except BudgetExceeded as err:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released") from None
            # Charged: from here the round is a release. The clean sum stays inside ``release_share``.
            share = run.release_share(request.round, weights, rank, private, [p.public_key for p in request.parties],
                                      support)
            del private
            return owner_pb2.StepReply(share=owner_pb2.Tensor(shape=[share.size], dtype=SHARE_DTYPE,
                                                               data=share.astype("<i8").tobytes()),
                                       epsilon_spent=report.epsilon_spent, charges=report.charges)

    def _checked_step_parties(self, run: AdmittedSteps, request: owner_pb2.StepRequest | owner_pb2.NearPrivateRequest,
                              mine: StepKey) -> int:
        """This gateway's rank once every party's key verifies for this very round and plan (``mine``:
        this gateway's), the parties are the admitted ones in their order, and their declared records
        add up to the run's."""
        denied = grpc.StatusCode.PERMISSION_DENIED
        owners = tuple(party.owner for party in request.parties)
        if owners != run.terms.parties:
            raise Refused(denied, f"the round's parties {list(owners)[:8]} are not the run's admitted parties "
                                  f"{list(run.terms.parties)}, in that order")
        for party in request.parties:
            key = step_key_of(party)
            try:
                self._verifier.verify(key, party.certificate, party.signature)
            except ForgedKey as err:
                raise Refused(denied, str(err)) from None
            if key.terms() != mine.terms():
                raise Refused(denied, f"owner {party.owner}'s key is for another round or other terms (run, round, d, "
                                      "clip, scale, z, q, steps) than this one")
            if party.owner == self.declaration.name and key != mine:
                raise Refused(denied, f"the key given as owner {self.declaration.name}'s is not the one this "
                                      f"gateway made for round {request.round}")
        records = sum(int(party.cell_bound) for party in request.parties)
        if records != run.terms.records:
            raise Refused(denied, f"the parties declare {records} records; the run was admitted for "
                                  f"{run.terms.records}")
        return owners.index(self.declaration.name)


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


def signed(key: RoundKey, certificate_pem: bytes, signature: bytes) -> owner_pb2.SignedKey:
    return owner_pb2.SignedKey(owner=key.owner, certificate=certificate_pem, public_key=key.public_key,
                               cell_bound=key.cell_bound, run=key.run, round=key.round, batch=key.batch,
                               classes=key.classes, sigma=key.sigma, signature=signature)
