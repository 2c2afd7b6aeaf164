"""DP-SGD on a benchmark's private shards held by Ray actors, and the private side of NearPrivate.

A ``ShardActor`` reads its shards itself (``ShardSource``); only DP output leaves: checkpoints and
NearPrivate's noised releases, through a secure sum when several actors hold shards. Plain actors,
not Ray Train workers. The schedule comes from a size fixed before any data is read, and every
secure round has a deadline from public figures: a silent actor ends the run in one line
(``OwnerDropout``). Owners' records train behind their gateways instead (``cluster.gateway``).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import ray
import torch
from torch import nn
from tqdm import tqdm

from conclave.actors.owners import GroupInfo, OwnerDataError, OwnerDropout, describe_all, nodes_of
from conclave.actors.placement import cpu_share, release, require_node
from conclave.errors import InvalidValue
from conclave.learning.annotation import split_private_public
from conclave.learning.data import Dataset, load_dataset, shard
from conclave.learning.data.features import apply_features
from conclave.learning.data.schema import Standardiser
from conclave.learning.dp_schedule import DPSGDConfig, dp_step_charge
from conclave.learning.dpsgd import train_dp
from conclave.learning.embedding_stats import covariance_sum, support_counts
from conclave.learning.secure_dpsgd import SecureGroup
from conclave.progress import COUNTS, waiting
from conclave.learning.models import build_model
from conclave.learning.selection.entropy import logit_entropy
from conclave.learning.training import embed, predict_logits
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger import BudgetExceeded, ChargeGate
from conclave.privacy.counts import LaplaceCounts, SkellamCounts
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.pca import AnalyzeGauss, SecureAnalyzeGauss
from conclave.privacy.secure_release import ReleaseKeys
from conclave.privacy.secure_sum import SecureSumPlan

log = logging.getLogger(__name__)

PROGRESS_POLL_S = 1.0  # how often the driver asks rank 0 how many epochs it finished
# Deadlines of the secure sums' rounds, from public figures only, so that an owner whose actor
# stops (or never answers) fails the run in one line instead of holding it forever, and whether a
# round meets its deadline does not follow the records an owner holds.
KEY_TIMEOUT_S = 30.0  # a key or a rendezvous address: no work on data, from actors that are idle
SHARE_BASE_S = 60.0  # a NearPrivate share: this, plus the work of its owner's declared records
SHARE_RATE = 1e8  # multiply-adds a second: a small part of one busy core, so an honest share is in time
# A held record's embedding and logits under a checkpoint's weights, one record at a time (so each is
# its own bit for bit): 5× a built-in model's time on a busy core, per declared record.
EMBED_RECORD_S = 0.01
STEP_TIMEOUT_S = 300.0  # one DP-SGD step's all-reduce (gloo's timeout): every rank's padded batch done


class ShardSource(Protocol):
    """Private shards as a spec the driver can pass around; only a shard actor calls ``load``."""

    owner: str

    def load(self, shard_ids: Sequence[int]) -> Dataset: ...


def _union(parts: Sequence[Dataset], name: str) -> Dataset:
    return Dataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                   parts[0].num_classes, name)


@dataclass(frozen=True)
class PrivateSource:
    """A benchmark's private shards: a seeded ``private_size`` subset of ``dataset``'s
    training set (the rest is the public pool, see ``split_private_public``), cut into
    ``num_shards`` disjoint shards, in the representation ``features`` (see
    ``learning.data.features``; None: images). Only the actors that hold shards call
    ``load``, so the features of private images are computed where the images stay."""

    dataset: str
    root: str | None
    private_size: int
    num_shards: int
    seed: int = 0
    features: str | None = None

    @property
    def owner(self) -> str:
        return f"{self.dataset} (private split)"

    def load(self, shard_ids: Sequence[int]) -> Dataset:
        train, _ = load_dataset(self.dataset, self.root)
        private, _ = split_private_public(train, self.private_size, self.seed)
        shards = shard(private, self.num_shards, self.seed)
        if not shard_ids or any(not 0 <= i < self.num_shards for i in shard_ids):
            raise InvalidValue(f"shard ids must be in [0, {self.num_shards}), got {list(shard_ids)}")
        held = _union([shards[i] for i in shard_ids], f"{private.name}/shards{list(shard_ids)}")
        return apply_features(held, self.features)


@dataclass(frozen=True)
class ModelSpec:
    """How every holder builds the same network (initial weights depend on ``seed`` only).
    The input hints go to ``build_model``: an image's side, or a table row's shape and the
    public column statistics."""

    name: str
    num_classes: int
    in_channels: int = 1
    seed: int = 0
    input_size: int | None = None  # the inputs' side, for models whose layers depend on it
    input_shape: tuple[int, ...] | None = None
    standardiser: Standardiser | None = None

    def build(self) -> nn.Module:
        return build_model(self.name, self.num_classes, self.in_channels, seed=self.seed,
                           input_size=self.input_size, input_shape=self.input_shape,
                           standardiser=self.standardiser)

    def prepare(self) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """The network to train and its masks (none: every parameter trains)."""
        return self.build(), {}


class TrainingRecipe(Protocol):
    """What a shard actor trains: a network and its per-parameter 0/1 masks (see ``train_dp``)."""

    def prepare(self) -> tuple[nn.Module, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class DataParallelGroup:
    """One actor's place in a gloo group: where rank 0 listens, its rank, and each rank's owner
    (public: it sizes the secure sum's noise shares)."""

    address: str  # tcp://host:port
    rank: int
    owners: tuple[str, ...]
    public_keys: tuple[bytes, ...]  # every rank's secure-sum key, passed on through Ray
    timeout_s: float = STEP_TIMEOUT_S  # each collective's

    @property
    def world(self) -> int:
        return len(self.owners)


@dataclass(frozen=True)
class DPCheckpoint:
    """The model after ``epoch`` epochs of DP-SGD and what releasing it costs."""

    epoch: int
    epsilon: float  # the schedule's accounting, at ``delta``
    delta: float
    sample_rate: float
    noise_multiplier: float
    steps: int
    state: dict[str, np.ndarray] = field(repr=False)
    secure: bool = False  # trained across actors through the secure sum (Skellam noise)
    screen_steps: int = 0  # a screening run's steps at the same q and σ, which chose the columns it reads

    def charge(self) -> PrivacyCharge:
        """The RDP of all steps up to this checkpoint (a screening run's included), for the ledger:
        the sampled Gaussian, or the subsampled Skellam of the secure sum."""
        return dp_step_charge(self.sample_rate, self.noise_multiplier, self.screen_steps + self.steps,
                              f"dpsgd-epoch-{self.epoch}", self.secure)

    def load_into(self, model: nn.Module) -> nn.Module:
        model.load_state_dict(_tensors(self.state))
        return model

    def save(self, path: str | Path) -> None:
        torch.save({**self.__dict__, "state": _tensors(self.state)}, path)

    @classmethod
    def load(cls, path: str | Path) -> DPCheckpoint:
        data = torch.load(path, weights_only=True)  # plain tensors and numbers: no pickled code runs
        return cls(**{**data, "state": {k: v.numpy() for k, v in data["state"].items()}})


def _state_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _tensors(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


@dataclass(frozen=True)
class HeldEmbeddings:
    """NearPrivate's clean aggregates of the held points under a public checkpoint, which never leave
    the actor (only a DP release of them, or a masked share): Σ x xᵀ of their unit-normalised
    embeddings, and per projected public point the held points with entropy ≥ the threshold
    nearest to it."""

    embeddings: np.ndarray
    entropy: np.ndarray

    @classmethod
    def of(cls, model: nn.Module, x: np.ndarray) -> HeldEmbeddings:
        # one record at a time: each record's embedding and entropy its own, bit for bit (a batch's
        # kernels round a row by its neighbours), so its vote is a function of it alone
        return cls(embed(model, x, batch_size=1), logit_entropy(predict_logits(model, x, batch_size=1)))

    def covariance(self) -> np.ndarray:
        return covariance_sum(self.embeddings)

    def support(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        return support_counts(self.embeddings, self.entropy, projection, public_points, threshold)


def _join(group: DataParallelGroup) -> None:
    """Join ``group``'s gloo process group as its rank."""
    if group.address.startswith("tcp://127."):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a loopback cluster stays on loopback
    torch.distributed.init_process_group("gloo", init_method=group.address, rank=group.rank,
                                         world_size=group.world,
                                         timeout=datetime.timedelta(seconds=group.timeout_s))


class ShardHolder(ReleaseKeys):
    """Holds private shards; trains on them and answers with DP output or aggregates only.
    A source that cannot be read is kept as an error that ``describe`` raises (one line,
    naming the owner), so the driver learns of it before any training starts."""

    def __init__(self, source: ShardSource, shard_ids: Sequence[int], model: ModelSpec | None = None,
                 torch_threads: int = 1) -> None:
        torch.set_num_threads(max(1, torch_threads))
        self._spec = model  # what ``train_dp`` trains unless given a recipe, and NearPrivate embeds with
        self._held: HeldEmbeddings | None = None  # NearPrivate's, from ``set_weights``
        self._load_error: str | None = None
        self._epochs_done = 0  # of the current ``train_dp``, for the driver's progress bar
        try:
            self._data = source.load(list(shard_ids))
        except (OSError, ValueError) as err:  # the owner's file: a missing path, a bad format
            self._load_error = f"owner {source.owner}: {err}".splitlines()[0]

    def describe(self) -> GroupInfo:
        if self._load_error is not None:
            raise OwnerDataError(self._load_error)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return GroupInfo(self._data.num_classes, self._data.input_shape, node)

    def rendezvous(self) -> str:
        """An address for rank 0 of a gloo group: this node's IP and a port free now."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return f"tcp://{host}:{probe.getsockname()[1]}"

    def train_dp(self, config: DPSGDConfig, noise: NoisePolicy, num_examples: int,
                 group: DataParallelGroup | None = None, recipe: TrainingRecipe | None = None) -> list[DPCheckpoint]:
        """DP-SGD on the held shards with the schedule of ``num_examples`` (declared, see the
        module docstring), alone or as one rank of ``group``; rank 0 returns one checkpoint
        per epoch (the weights are DP output), the other ranks nothing. ``epochs_done`` says how
        far it is, meanwhile."""
        recipe = recipe or self._spec
        if recipe is None:
            raise InvalidValue("nothing to train: this shard actor has no model spec, so give a recipe")
        model, masks = recipe.prepare()
        snapshots: list[dict[str, np.ndarray]] = []
        rank = group.rank if group else 0
        self._epochs_done = 0

        def on_epoch(epoch: int, epsilon: float) -> None:
            # train_dp updates ``model``'s parameters in place, so a snapshot after each epoch
            # is that epoch's DP model.
            if rank == 0:
                snapshots.append(_state_of(model))
            self._epochs_done = epoch + 1

        secure = None
        if group is not None:
            secure = SecureGroup(group.owners, self._take_mask_keys(group.public_keys), group.public_keys)
            _join(group)
        try:
            result = train_dp(model, self._data, config, noise.source(f"dpsgd-{rank}"), masks=masks,
                              on_epoch=on_epoch, num_examples=num_examples, secure_group=secure)
        finally:
            if group is not None:
                torch.distributed.destroy_process_group()
        if rank != 0:
            return []
        steps_per_epoch = result.steps // config.epochs
        return [DPCheckpoint(epoch + 1, eps, config.delta, result.sample_rate, result.noise_multiplier,
                             steps_per_epoch * (epoch + 1), state, result.schedule.secure)
                for epoch, (eps, state) in enumerate(zip(result.epsilons, snapshots))]

    def epochs_done(self) -> int:
        """Epochs of the running ``train_dp`` finished (public: the schedule's, and in a secure
        sum each step's time is fixed by its padded batch, ``learning.secure_dpsgd``)."""
        return self._epochs_done

    def set_weights(self, state: dict[str, np.ndarray]) -> None:
        """Use a DP checkpoint's weights (public) for the embeddings and uncertainties below."""
        model = self._spec.build()
        model.load_state_dict(_tensors(state))
        self._held = HeldEmbeddings.of(model, self._data.x)

    # NearPrivate's sums (``HeldEmbeddings``): only a DP release (one holder) or a masked share leaves.

    def embedding_dimension(self) -> int:
        """d of the embeddings (public: the width of the model's features, fixed by its architecture)."""
        return int(self._weighted().embeddings.shape[1])

    def release_projection(self, mechanism: AnalyzeGauss, components: int, noise: NoisePolicy) -> np.ndarray:
        """DP-PCA of the held points' covariance sum, noised here (this actor holds all private data)."""
        return mechanism.release(self._weighted().covariance(), components, noise.source("dp-pca"))

    def release_counts(self, mechanism: LaplaceCounts, projection: np.ndarray, public_points: np.ndarray,
                       threshold: float, noise: NoisePolicy) -> np.ndarray:
        """Noisy counts of the held voters nearest each public point, noised here (one holder)."""
        counts = self._weighted().support(projection, public_points, threshold)
        return mechanism.release(counts, noise.source("support-counts"))

    def covariance_share(self, mechanism: SecureAnalyzeGauss, plan: SecureSumPlan, owners: tuple[str, ...],
                         public_keys: tuple[bytes, ...], session: str, noise: NoisePolicy) -> np.ndarray:
        """This actor's masked share of the secure covariance sum (keys from ``mask_key`` just before)."""
        held = self._weighted()
        keys = self._take_mask_keys(public_keys)
        return mechanism.share(held.covariance(), plan, owners,
                               keys.pairwise_masks(public_keys, session), noise.source(f"{session}-{keys.rank}"))

    def counts_share(self, mechanism: SkellamCounts, plan: SecureSumPlan, owners: tuple[str, ...],
                     public_keys: tuple[bytes, ...], session: str, noise: NoisePolicy, projection: np.ndarray,
                     public_points: np.ndarray, threshold: float) -> np.ndarray:
        """This actor's masked share of the secure sum of support counts."""
        held = self._weighted()
        keys = self._take_mask_keys(public_keys)
        counts = held.support(projection, public_points, threshold)
        return mechanism.share(counts, plan, owners, keys.pairwise_masks(public_keys, session),
                               noise.source(f"{session}-{keys.rank}"))

    def _weighted(self) -> HeldEmbeddings:
        if self._held is None:
            raise RuntimeError("call set_weights(checkpoint.state) before asking for private sums")
        return self._held


ShardActor = ray.remote(ShardHolder)


def gathered(refs: list[ray.ObjectRef], owners: Sequence[str], timeout_s: float, asked: str, round_name: str,
             outcome: str) -> list:
    """Every owner's answer to one call of a secure round (``refs[i]`` from ``owners[i]``'s actor)
    within ``timeout_s``, in order; or ``OwnerDropout`` in one line naming the first owner whose actor
    died, or sent no ``asked`` for ``round_name`` in time (``outcome``: what that leaves). On the way
    out the calls not done are cancelled and ``refs`` is emptied, so no reference to the round's
    answers is kept: a timed-out Ray task's result still arrives otherwise (as ``actors.vote_parties``)."""
    deadline = time.monotonic() + timeout_s
    answers: list = [None] * len(refs)
    waiting = list(range(len(refs)))
    failure: str | None = None
    try:
        while waiting and failure is None:
            ready, rest = ray.wait([refs[i] for i in waiting], num_returns=1,
                                   timeout=max(0.0, deadline - time.monotonic()))
            rest.clear()
            if not ready:
                failure = f"owner {owners[waiting[0]]} sent no {asked} for {round_name} within {timeout_s:g} s"
                break
            index = next(i for i in waiting if refs[i] == ready[0])
            ready.clear()
            try:
                answers[index] = ray.get(refs[index])
            except ray.exceptions.RayActorError:
                failure = f"owner {owners[index]} dropped out of {round_name} (its actor died)"
            else:
                waiting.remove(index)
    finally:
        for index in waiting:  # (cancelling a call already done does nothing)
            ray.cancel(refs[index])
        refs.clear()
        if waiting:  # a dropout, or a call that raised: nothing of the round is kept
            answers.clear()
    if failure is not None:
        raise OwnerDropout(f"{failure}: {outcome}")
    return answers


def fresh_public_keys(actors: Sequence, owners: Sequence[str], what: str, outcome: str,
                      timeout_s: float = KEY_TIMEOUT_S) -> tuple[bytes, ...]:
    """Every shard actor's new X25519 public key for the next secure sum of ``what``, in rank
    order, collected and passed on through Ray (mutually authenticated under TLS), never over the
    gloo link; ``OwnerDropout`` naming the owner whose key is not in within ``timeout_s``."""
    return tuple(gathered([actor.mask_key.remote(rank) for rank, actor in enumerate(actors)], owners, timeout_s,
                          "key", f"the secure sum of {what}", outcome))


class ShardSupport:
    """NearPrivate's ``PrivateSupport`` over shard actors; the ledger is charged (``charge``)
    before each release.

    One actor (it holds all the private data): it computes each sum and adds the noise itself
    (``AnalyzeGauss``, ``LaplaceCounts``); nothing else leaves it. Several actors
    (``owners[rank]`` each one's owner): every release is one secure sum (``SecureAnalyzeGauss``,
    ``SkellamCounts``). Each actor makes a fresh key pair, the driver passes the public keys
    around through Ray, each actor returns only its masked share (its part quantized, plus its
    Skellam noise share, under pairwise masks: uniform on the ring on its own), and the driver
    adds the shares and decodes the noised total. ``records`` (public: the declared private
    records) bounds every actor's part, to size the ring.

    A secure release is checked against the ledger before any key is asked for, and charged once
    every key is in, before any share is asked for: from then on the release is in the hands of
    whoever holds this process (honest code drops an abandoned release, but a curious driver
    could keep the shares and decode them once a late one arrives), so it is paid for first. The
    keys have ``key_timeout_s``, the shares ``share_timeout_s`` of the work of the declared
    records; an owner whose actor dies or does not answer in time stops the run
    (``OwnerDropout``, one line naming it): nothing is released, calls not done are cancelled and
    no reference to the shares is kept; charged if its shares were asked for, else not.
    """

    key_timeout_s: float = KEY_TIMEOUT_S
    share_base_s: float = SHARE_BASE_S

    def __init__(self, actors: Sequence, owners: Sequence[str], pca: AnalyzeGauss | SecureAnalyzeGauss,
                 counts: LaplaceCounts | SkellamCounts, ledger: ChargeGate, noise: NoisePolicy,
                 records: int) -> None:
        self._actors, self._owners = list(actors), tuple(owners)
        if not self._actors or len(self._owners) != len(self._actors):
            raise InvalidValue(f"expected one owner per shard actor, got {len(self._owners)} for {len(self._actors)}")
        self.secure = len(self._actors) > 1
        expected = (SecureAnalyzeGauss, SkellamCounts) if self.secure else (AnalyzeGauss, LaplaceCounts)
        if not (isinstance(pca, expected[0]) and isinstance(counts, expected[1])):
            raise InvalidValue(f"{len(self._actors)} shard actor(s) release through {expected[0].__name__} and "
                             f"{expected[1].__name__}, got {type(pca).__name__} and {type(counts).__name__}: "
                             "the ledger would be charged for another mechanism than the one that runs")
        if records < 1:
            raise InvalidValue(f"records must be >= 1, got {records}")
        self._pca, self._counts, self._ledger, self._noise, self._records = pca, counts, ledger, noise, records

    def dp_projection(self, components: int) -> np.ndarray:
        if not self.secure:
            self._ledger.charge(self._pca.charge())
            return ray.get(self._actors[0].release_projection.remote(self._pca, components, self._noise))
        dimension = self._dimension("dp-pca")
        plan = self._pca.plan(dimension, self._owners, self._records)
        shares = self._shares(self._pca.charge(), "dp-pca", dimension * dimension,
                              lambda actor, keys: actor.covariance_share.remote(
                                  self._pca, plan, self._owners, keys, "dp-pca", self._noise))
        return self._pca.release(shares, components, plan)

    def noisy_support(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        if not self.secure:
            self._ledger.charge(self._counts.charge())
            return ray.get(self._actors[0].release_counts.remote(self._counts, projection, public_points, threshold,
                                                                 self._noise))
        plan = self._counts.plan(len(public_points), self._owners, self._records)
        # each held point: its projection (d × k), then its nearest public point (at most P × k)
        work = projection.shape[1] * (projection.shape[0] + len(public_points))
        shares = self._shares(self._counts.charge(), "support-counts", work,
                              lambda actor, keys: actor.counts_share.remote(
                                  self._counts, plan, self._owners, keys, "support-counts", self._noise, projection,
                                  public_points, threshold))
        return self._counts.release(shares, plan)

    def share_timeout_s(self, work_per_record: float) -> float:
        """How long the shares of a release may take: ``share_base_s``, plus the multiply-adds of
        each declared record at ``SHARE_RATE`` (public figures only; none of them is what is held)."""
        return self.share_base_s + self._records * work_per_record / SHARE_RATE

    def _dimension(self, what: str) -> int:
        """d of the embeddings (public: fixed by the model's architecture), asked of rank 0."""
        return gathered([self._actors[0].embedding_dimension.remote()], self._owners[:1], self.key_timeout_s,
                        "embedding width", f"the secure sum of {what}", "nothing was released or charged")[0]

    def _shares(self, cost: PrivacyCharge, what: str, work_per_record: float, share_of: Callable) -> list[np.ndarray]:
        """Every actor's masked share of one release (class docstring): refused before any key is
        made when the ledger cannot afford it, charged once the keys are in."""
        if not self._ledger.can_afford(cost):
            raise BudgetExceeded(f"{what}: the run's budget cannot afford this release; nothing was computed")
        public_keys = fresh_public_keys(self._actors, self._owners, what,
                                        "no share was asked for, so nothing was released or charged",
                                        self.key_timeout_s)
        self._ledger.charge(cost)
        return gathered([share_of(actor, public_keys) for actor in self._actors], self._owners,
                        self.share_timeout_s(work_per_record), "share", f"the secure sum of {what}",
                        "its shares were asked for, so it was charged; nothing of it was released")



@dataclass(frozen=True)
class ShardPlan:
    """One shard actor: its source and the shards it holds."""

    source: ShardSource
    shard_ids: tuple[int, ...]


class ShardGroup:
    """The run's shard actors: checked before any starts (a request no node can take fails at
    once, one line), loaded before any trains, their inputs (if ``input_shape`` is given) of the
    shape the model is built for.

    Data-parallel DP-SGD waits ``key_timeout_s`` for rank 0's address and every key, and each
    step's all-reduce waits ``step_timeout_s`` (both public constants); an owner whose actor dies
    or stops answering stops the run in one line naming it (``OwnerDropout``)."""

    key_timeout_s: float = KEY_TIMEOUT_S
    step_timeout_s: float = STEP_TIMEOUT_S
    share_base_s: float = SHARE_BASE_S

    def __init__(self, plans: Sequence[ShardPlan], model: ModelSpec | None = None, torch_threads: int = 1,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, start_timeout_s: float = 300.0,
                 input_shape: tuple[int, ...] | None = None) -> None:
        if not plans:
            raise InvalidValue("a shard group needs at least one shard actor")
        # They train as one group, so all must run at once: no more CPU each than an even share.
        num_cpus = min(num_cpus, cpu_share(float(ray.cluster_resources().get("CPU", 1.0)), len(plans)))
        require_node("the DP-SGD shard actors", num_cpus, num_gpus)
        # Two calls at once: ``epochs_done`` is answered while ``train_dp`` runs.
        self.actors = [ShardActor.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=2).remote(
                           plan.source, list(plan.shard_ids), model, torch_threads)
                       for plan in plans]
        self._cpus_each = num_cpus
        owners = [plan.source.owner for plan in plans]
        self.owners = tuple(owners)  # each rank's owner
        # Fail rather than wait forever for actors that cannot start beside the others.
        with waiting("starting the shard actors (each loads its shards)"):
            described = describe_all(self.actors, owners, self.shutdown, start_timeout_s)
        self.num_classes, self.input_shape = described[0].num_classes, described[0].input_shape
        if input_shape is not None and self.input_shape != tuple(input_shape):
            self.shutdown()
            raise OwnerDataError(f"the owners' inputs are {list(self.input_shape)}, the public data's "
                                 f"{list(input_shape)}: the model is built for the public data's")
        self.placement = nodes_of(owners, described)

    @property
    def secure(self) -> bool:
        """Whether sums cross actors (DP-SGD's and NearPrivate's), through the secure sum (then charged as such)."""
        return len(self.actors) > 1

    def train(self, config: DPSGDConfig, noise: NoisePolicy, num_examples: int,
              recipe: TrainingRecipe | None = None, progress: bool = False) -> list[DPCheckpoint]:
        """DP-SGD with the schedule of ``num_examples`` over all actors (data-parallel when
        there are several); one checkpoint per epoch, oldest first. ``progress``: a bar of the
        epochs rank 0 has finished (its actor answers ``epochs_done`` while it trains)."""
        if len(self.actors) == 1:
            ranks = [self.actors[0].train_dp.remote(config, noise, num_examples, None, recipe)]
        else:
            before = "nothing was trained or released"
            [address] = gathered([self.actors[0].rendezvous.remote()], self.owners[:1], self.key_timeout_s,
                                 "address", "the secure sum of DP-SGD", before)
            public_keys = fresh_public_keys(self.actors, self.owners, "DP-SGD", before, self.key_timeout_s)
            log.info("data-parallel DP-SGD over %d shard actors through a secure sum (rank 0 at %s)",
                     len(self.actors), address)
            ranks = [actor.train_dp.remote(config, noise, num_examples,
                                           DataParallelGroup(address, rank, self.owners, public_keys,
                                                             self.step_timeout_s), recipe)
                     for rank, actor in enumerate(self.actors)]
        pending = list(ranks)
        asked: ray.ObjectRef | None = None  # rank 0's epochs, asked once at a time: a stopped actor never answers
        with tqdm(total=config.epochs, desc="DP-SGD", unit="epochs", bar_format=COUNTS, disable=not progress) as bar:
            try:
                while pending:  # the first failure raises at once instead of after the others time out
                    done, pending = ray.wait(pending, num_returns=1, timeout=PROGRESS_POLL_S)
                    if done:
                        ray.get(done)
                    if progress and pending:
                        if asked is not None and ray.wait([asked], timeout=0)[0]:
                            bar.update(ray.get(asked) - bar.n)
                            asked = None
                        if asked is None:
                            asked = self.actors[0].epochs_done.remote()
            except ray.exceptions.RayError:
                if len(ranks) > 1:
                    self._raise_dropout(ranks)
                raise
            bar.update(config.epochs - bar.n)
        return ray.get(ranks[0])

    def _raise_dropout(self, ranks: list[ray.ObjectRef]) -> None:
        """After a failed secure sum: the owner whose actor died or stopped, in one line. Every
        actor is asked how far it is (``epochs_done`` has a thread of its own, so a live actor
        answers at once, even waiting in the collective); one that is dead, or that does not
        answer within ``key_timeout_s`` (stopped), dropped out. Then the ranks' calls not done are
        cancelled. If every actor answers, the failure was something else, and it is raised."""
        try:
            gathered([actor.epochs_done.remote() for actor in self.actors], self.owners, self.key_timeout_s,
                     "answer", "the secure sum of DP-SGD",
                     "the run stops and releases nothing of the unfinished round")
        except OwnerDropout:
            _, unfinished = ray.wait(ranks, num_returns=len(ranks), timeout=0)
            for ref in unfinished:
                ray.cancel(ref)
            raise

    def load_weights(self, state: dict[str, np.ndarray], records: int) -> None:
        """Every shard actor loads the public checkpoint ``state`` and embeds its held records under it
        before NearPrivate asks for its sums; ``OwnerDropout`` in one line naming an owner whose actor
        died or did not answer within ``share_base_s`` plus ``EMBED_RECORD_S`` for each of the
        ``records`` declared (public figures; nothing is charged before that)."""
        gathered([actor.set_weights.remote(state) for actor in self.actors], self.owners,
                 self.share_base_s + records * EMBED_RECORD_S, "acknowledgement of the checkpoint's weights",
                 "NearPrivate's selection", "nothing was charged")

    def support(self, pca: AnalyzeGauss | SecureAnalyzeGauss, counts: LaplaceCounts | SkellamCounts,
                ledger: ChargeGate, noise: NoisePolicy, records: int) -> ShardSupport:
        """NearPrivate's private side over these actors: secure sums when there are several
        (the secure mechanisms then), else the one actor noises its own sums."""
        return ShardSupport(self.actors, self.owners, pca, counts, ledger, noise, records)

    def shutdown(self) -> None:
        release(self.actors, self._cpus_each)

    def __enter__(self) -> ShardGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
