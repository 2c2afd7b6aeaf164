"""DP-SGD on private shards held by Ray actors, and the private side of NearPrivate.

Private data is read by the process that keeps it — a ``ShardActor`` or a Ray Train worker —
from a ``PrivateSource`` (dataset name, root, split seed); it never passes through the driver.
What leaves those processes is DP output only: model checkpoints of DP-SGD, and aggregates
(summed covariances, neighbour counts) that go straight to a Ray task that adds them up,
draws the noise once and returns the noisy release. The driver charges the ledger before it
asks for a release and never sees an exact private sum.

Two ways to train:

(a) ``ShardActor.train_dp`` — one actor trains alone on the shards it holds, with
    ``learning.dpsgd.train_dp`` (Opacus, Poisson sampling).
(b) ``train_distributed`` — data-parallel DP-SGD across one Ray Train worker per shard
    (``TorchTrainer``, gloo on CPU) with Opacus's distributed pieces (``DPDDP`` to start every
    worker from the same weights, ``DistributedDPOptimizer``). It is calibrated to be exactly
    central DP-SGD on the union of the shards (Abadi et al. 2016 with Poisson sampling):

    * every worker includes each of ITS examples independently with the SAME probability
      q = 1/⌈N/B⌉ (N = total private size, B = expected global batch; the rate
      ``train_dp`` uses), so the union of the workers' batches is a Poisson sample of the
      union at rate q, and all workers take the same ⌈N/B⌉ steps per epoch;
    * each worker clips its examples' gradients to C and sums them; the sums are all-reduced
      and Gaussian noise N(0, σ²C²) is added ONCE, by rank 0 (``DistributedDPOptimizer``),
      not once per worker; each worker divides by qN/W, so after the all-reduce mean the
      update is (Σ clipped + noise)/(qN) as in central DP-SGD;
    * hence the privacy cost is the sampled Gaussian mechanism with (q, σ, steps) —
      Mironov, Talwar, Zhang 2019 — the same accountant and the same ε as central DP-SGD.

    Every epoch rank 0 saves a checkpoint carrying its ε; the driver charges the ledger with
    ``DPCheckpoint.charge()`` of the checkpoint it releases.

Noise and Poisson sampling come from the run's ``NoisePolicy`` (OS entropy unless the run asks
for reproducible, unsound noise), drawn in the process that uses them; the schedule (q, σ,
steps) comes from ``learning.dpsgd.dp_schedule`` alone. No loss or other statistic of the
private data leaves these processes: only DP weights, their ε, and noisy releases.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import ray
import torch
from torch import nn

from learning.annotation import split_private_public
from learning.data import Dataset, load_dataset, shard
from learning.data.features import apply_features
from learning.dpsgd import DPSGDConfig, dp_schedule, lr_scheduler, torch_generator, train_dp
from learning.embedding_stats import covariance_sum, support_counts
from learning.models import build_model
from learning.selection.entropy import logit_entropy
from learning.training import embed, predict_logits
from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import sampled_gaussian_charge
from privacy.counts import LaplaceCounts
from privacy.noise import NoisePolicy
from privacy.pca import AnalyzeGauss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivateSource:
    """Where the private shards come from: a seeded ``private_size`` subset of ``dataset``'s
    training set (the rest is the public pool, see ``split_private_public``), cut into
    ``num_shards`` disjoint shards, in the representation ``features`` (see
    ``learning.data.features``; None: images). Only the processes that hold shards call
    ``load``, so the features of private images are computed where the images stay."""

    dataset: str
    root: str | None
    private_size: int
    num_shards: int
    seed: int = 0
    features: str | None = None

    def load(self, shard_ids: Sequence[int]) -> Dataset:
        train, _ = load_dataset(self.dataset, self.root)
        private, _ = split_private_public(train, self.private_size, self.seed)
        shards = shard(private, self.num_shards, self.seed)
        if not shard_ids or any(not 0 <= i < self.num_shards for i in shard_ids):
            raise ValueError(f"shard ids must be in [0, {self.num_shards}), got {list(shard_ids)}")
        parts = [shards[i] for i in shard_ids]
        held = Dataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                       private.num_classes, f"{private.name}/shards{list(shard_ids)}")
        return apply_features(held, self.features)


@dataclass(frozen=True)
class ModelSpec:
    """How every holder builds the same network (initial weights depend on ``seed`` only)."""

    name: str
    num_classes: int
    in_channels: int = 1
    seed: int = 0
    input_size: int | None = None  # the inputs' side, for models whose layers depend on it

    def build(self) -> nn.Module:
        return build_model(self.name, self.num_classes, self.in_channels, seed=self.seed,
                           input_size=self.input_size)


@dataclass(frozen=True)
class DPCheckpoint:
    """The model after ``epoch`` epochs of DP-SGD and what releasing it costs."""

    epoch: int
    epsilon: float  # Opacus RDP accountant, at ``delta``
    delta: float
    sample_rate: float
    noise_multiplier: float
    steps: int
    state: dict[str, np.ndarray] = field(repr=False)

    def charge(self) -> PrivacyCharge:
        """The sampled Gaussian RDP of all steps up to this checkpoint, for the ledger."""
        return sampled_gaussian_charge(self.sample_rate, self.noise_multiplier, self.steps,
                                       label=f"dpsgd-epoch-{self.epoch}")

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


@ray.remote
class ShardActor:
    """Holds private shards; trains on them and answers with DP output or aggregates only."""

    def __init__(self, source: PrivateSource, shard_ids: Sequence[int], model: ModelSpec,
                 torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        self._data = source.load(list(shard_ids))
        self._spec = model
        self._model = model.build()
        self._embeddings: np.ndarray | None = None
        self._entropy: np.ndarray | None = None

    def size(self) -> int:
        return len(self._data)

    def train_dp(self, config: DPSGDConfig, noise: NoisePolicy, progress: bool = False) -> list[DPCheckpoint]:
        """DP-SGD alone on the held shards; one checkpoint per epoch (the weights are DP output)."""
        model = self._spec.build()
        snapshots: list[dict[str, np.ndarray]] = []
        # train_dp updates ``model``'s parameters in place, so a snapshot after each epoch is
        # that epoch's DP model.
        result = train_dp(model, self._data, config, noise.source("dpsgd"),
                          on_epoch=lambda epoch, eps: snapshots.append(_state_of(model)), progress=progress)
        steps_per_epoch = result.steps // config.epochs
        self.set_weights(snapshots[-1])
        return [DPCheckpoint(epoch + 1, eps, config.delta, result.sample_rate, result.noise_multiplier,
                             steps_per_epoch * (epoch + 1), state)
                for epoch, (eps, state) in enumerate(zip(result.epsilons, snapshots))]

    def set_weights(self, state: dict[str, np.ndarray]) -> None:
        """Use a DP checkpoint's weights (public) for the embeddings and uncertainties below."""
        self._model.load_state_dict(_tensors(state))
        self._embeddings = embed(self._model, self._data.x)
        self._entropy = logit_entropy(predict_logits(self._model, self._data.x))

    def covariance_sum(self) -> np.ndarray:
        """[d, d] Σ x xᵀ of the unit-normalised embeddings of the held points (an aggregate)."""
        self._require_weights()
        return covariance_sum(self._embeddings)

    def support_counts(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        """int64 [m]: per projected public point, the held points with entropy ≥ ``threshold``
        whose projection is nearest to it (an aggregate)."""
        self._require_weights()
        return support_counts(self._embeddings, self._entropy, projection, public_points, threshold)

    def _require_weights(self) -> None:
        if self._embeddings is None:
            raise RuntimeError("call set_weights(checkpoint.state) before asking for private sums")


@ray.remote(num_cpus=0)
def _release_projection(mechanism: AnalyzeGauss, components: int, noise: NoisePolicy, *parts: np.ndarray) -> np.ndarray:
    # Ray resolves ``parts`` (object refs from the shard actors) here, not on the driver.
    return mechanism.release(np.sum(parts, axis=0), components, noise.source("dp-pca"))


@ray.remote(num_cpus=0)
def _release_counts(mechanism: LaplaceCounts, noise: NoisePolicy, *parts: np.ndarray) -> np.ndarray:
    return mechanism.release(np.sum(parts, axis=0), noise.source("support-counts"))


class ShardSupport:
    """NearPrivate's ``PrivateSupport`` over shard actors: sums inside the actors, noise added
    once to the total in a Ray task, the ledger charged (``charge``) before each release."""

    def __init__(self, actors: Sequence, pca: AnalyzeGauss, counts: LaplaceCounts,
                 charge: Callable[[PrivacyCharge], object], noise: NoisePolicy) -> None:
        self._actors, self._pca, self._counts, self._charge = list(actors), pca, counts, charge
        self._noise = noise

    def dp_projection(self, components: int) -> np.ndarray:
        parts = [a.covariance_sum.remote() for a in self._actors]
        self._charge(self._pca.charge())
        return ray.get(_release_projection.remote(self._pca, components, self._noise, *parts))

    def noisy_support(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        parts = [a.support_counts.remote(projection, public_points, threshold) for a in self._actors]
        self._charge(self._counts.charge())
        return ray.get(_release_counts.remote(self._counts, self._noise, *parts))


# ---- (b) data-parallel DP-SGD with Ray Train ---------------------------------------------


def _distributed_worker(cfg: dict) -> None:
    """One Ray Train worker: holds shard ``rank``; see the module docstring for the calibration."""
    import ray.train
    import torch.distributed as dist
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.data_loader import DPDataLoader
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.optimizers import DistributedDPOptimizer
    from torch.utils.data import TensorDataset

    config: DPSGDConfig = cfg["dpsgd"]
    noise: NoisePolicy = cfg["noise"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(cfg["torch_threads"])
    data = cfg["source"].load([rank])

    total = torch.tensor([len(data)], dtype=torch.long)
    dist.all_reduce(total)  # N, the size of the union (public in DP-SGD's analysis, as in train_dp)
    schedule = dp_schedule(int(total.item()), config)
    sample_rate, sigma = schedule.sample_rate, schedule.noise_multiplier

    model = cfg["model"].build()
    private_model = GradSampleModule(DPDDP(model))  # DPDDP broadcasts rank 0's weights
    optimizer = DistributedDPOptimizer(
        torch.optim.SGD(private_model.parameters(), lr=config.lr, momentum=config.momentum),
        noise_multiplier=sigma, max_grad_norm=config.max_grad_norm,
        # per worker: the all-reduce mean divides by W
        expected_batch_size=sample_rate * int(total.item()) / world,
        generator=torch_generator(noise.source(f"dpsgd-noise-{rank}")), secure_mode=True)
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    # Independent Poisson draws per worker, same rate, same number of steps.
    loader = DPDataLoader(TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y)),
                          sample_rate=sample_rate, generator=torch_generator(noise.source(f"dpsgd-sampling-{rank}")))
    if len(loader) * config.epochs != schedule.steps:
        raise RuntimeError("the data loader and the privacy schedule disagree on the number of steps")
    scheduler = lr_scheduler(optimizer.original_optimizer, config, total_steps=schedule.steps)
    criterion = nn.CrossEntropyLoss()
    steps = 0
    for epoch in range(1, config.epochs + 1):
        private_model.train()
        for x, y in loader:
            optimizer.zero_grad()
            out = private_model(x)
            # An empty local batch still steps (the others' examples and rank 0's noise still count).
            loss = criterion(out, y) if len(y) else out.sum() * 0.0
            loss.backward()
            optimizer.step()
            scheduler.step()
            steps += 1
        epsilon = float(accountant.get_epsilon(config.delta))
        metrics = {"epoch": epoch, "epsilon": epsilon, "steps": steps}  # nothing about the data itself
        if rank == 0:
            with tempfile.TemporaryDirectory() as directory:
                DPCheckpoint(epoch, epsilon, config.delta, sample_rate, float(sigma), steps,
                             _state_of(model)).save(Path(directory) / "dp_checkpoint.pt")
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        else:
            ray.train.report(metrics)


def train_distributed(source: PrivateSource, model: ModelSpec, config: DPSGDConfig, noise: NoisePolicy,
                      storage_path: str, name: str = "dpsgd", cpus_per_worker: float = 1.0,
                      torch_threads: int = 1) -> list[DPCheckpoint]:
    """Central-equivalent DP-SGD over ``source.num_shards`` Ray Train workers (one shard each);
    returns one checkpoint per epoch, oldest first."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        _distributed_worker,
        train_loop_config={"source": source, "model": model, "dpsgd": config, "noise": noise,
                           "torch_threads": torch_threads},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=source.num_shards, use_gpu=False,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=storage_path, checkpoint_config=CheckpointConfig(num_to_keep=None)),
    )
    log.info("data-parallel DP-SGD over %d Ray Train workers", source.num_shards)
    result = trainer.fit()
    checkpoints = []
    for checkpoint, _ in result.best_checkpoints or []:
        with checkpoint.as_directory() as directory:
            checkpoints.append(DPCheckpoint.load(Path(directory) / "dp_checkpoint.pt"))
    if len(checkpoints) != config.epochs:
        raise RuntimeError(f"expected {config.epochs} checkpoints from Ray Train, got {len(checkpoints)}")
    return sorted(checkpoints, key=lambda c: c.epoch)
