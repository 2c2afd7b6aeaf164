"""DP-SGD with Opacus, optionally training only a masked subset of each parameter.

Poisson sampling and noise come from the run's ``NoiseSource`` (OS entropy), never the seed; the
charge is ``privacy.accounting.rdp.sampled_gaussian_charge`` of the same (q, σ, steps). Across
owners the clipped sums meet only in a secure sum (``learning.secure_dpsgd``). An example whose
loss or norm is not finite adds exactly 0 (``learning.finite_clipping``), and a mask acts before
clipping; nothing but the DP weights leaves ``train_dp``. docs/privacy.md, "Clipping no record
can break".
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from opacus.utils.batch_memory_manager import wrap_data_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from conclave.errors import InvalidValue
from conclave.learning.dp_schedule import DPSGDConfig, DPSchedule, dp_schedule  # torch-free: `conclave plan` uses it
from conclave.learning.finite_clipping import FiniteDPOptimizer, finite_losses
from conclave.learning.grad_sample_modes import PROBED, clipped, fastest_mode, privacy_engine
from conclave.learning.secure_dpsgd import (PaddedPoissonBatches, SecureAggregation, SecureGroup, SecureSumDPOptimizer,
                                            broadcast_parameters, row_major, trainable_entries)
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.noise import NoiseSource

log = logging.getLogger(__name__)

class ArrayDataset(Protocol):
    x: np.ndarray
    y: np.ndarray


@dataclass
class DPTrainResult:
    """What a DP-SGD run produced and what it cost (no statistic of the private data)."""

    model: nn.Module
    epsilons: list[float]  # the schedule's ε after each epoch, at config.delta
    noise_multiplier: float
    sample_rate: float
    steps: int
    charge: PrivacyCharge  # the whole run, for the ledger
    schedule: DPSchedule  # what each checkpoint of it costs (``charge_after``)

    @property
    def epsilon(self) -> float:
        return self.epsilons[-1]


class MaskedDPOptimizer(FiniteDPOptimizer):
    """Flat clipping (``FiniteDPOptimizer``) with a per-element 0/1 mask per parameter.

    The mask is applied to ``p.grad_sample`` before the per-example norms are computed
    (so the clipped norm is the masked gradient's norm) and to the noise. Parameters
    without a mask behave exactly as in ``FiniteDPOptimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, masks: dict[nn.Parameter, torch.Tensor], **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        managed = {id(p) for p in self.params}
        for p in masks:
            if id(p) not in managed:
                raise InvalidValue("a mask was given for a parameter this optimizer does not train")
        self._masks = {id(p): m.to(device=p.device, dtype=p.dtype) for p, m in masks.items()}

    def _mask_of(self, p: nn.Parameter) -> torch.Tensor | None:
        return self._masks.get(id(p))

    def clip_and_accumulate(self) -> None:
        for p in self.params:
            mask = self._mask_of(p)
            if mask is None or getattr(p, "grad_sample", None) is None:
                continue
            # grad_sample is [batch, *p.shape] (a list of those when accumulating); it is
            # outside the autograd graph, so masking in place saves a batch-sized copy. Filled,
            # not multiplied: a frozen entry adds nothing to the norm, even an infinite one.
            for g in p.grad_sample if isinstance(p.grad_sample, list) else [p.grad_sample]:
                g.masked_fill_(mask == 0, 0.0)
        super().clip_and_accumulate()

    def add_noise(self) -> None:
        super().add_noise()
        # summed_grad is exactly 0 outside the mask, so p.grad * mask == summed + noise ⊙ mask.
        for p in self.params:
            mask = self._mask_of(p)
            if mask is not None:
                p.grad = p.grad * mask


def lr_scheduler(optimizer: torch.optim.Optimizer, config: DPSGDConfig,
                 total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Per-step learning-rate schedule: ``constant``, or ``cosine`` from each group's rate
    down to 0 at ``total_steps``. Under DP-SGD the late, small steps average the noise of
    many updates instead of letting the last few noisy steps move the weights (the schedule
    is a function of the step count only, so it costs no privacy)."""
    if config.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def torch_generator(noise: NoiseSource, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator for DP randomness (sampling or noise), seeded from ``noise``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(noise.seed())
    return generator


def param_groups(model: nn.Module, config: DPSGDConfig) -> list[dict]:
    """The optimizer's groups: every trainable parameter at its rate (``lr_overrides`` by name prefix)."""
    groups: dict[float, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lr = next((lr for prefix, lr in config.lr_overrides if name.startswith(prefix)), config.lr)
        groups.setdefault(lr, []).append(p)
    if not groups:
        raise InvalidValue("the model has no trainable parameters (all have requires_grad=False)")
    return [{"params": params, "lr": lr} for lr, params in groups.items()]


def _check_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
    params = dict(model.named_parameters())
    resolved = {}
    for name, mask in masks.items():
        if name not in params:
            raise InvalidValue(f"mask for unknown parameter {name!r}")
        p = params[name]
        if not p.requires_grad:
            raise InvalidValue(f"mask for frozen parameter {name!r} (requires_grad=False)")
        if tuple(mask.shape) != tuple(p.shape):
            raise InvalidValue(f"mask for {name!r} has shape {tuple(mask.shape)}, parameter has {tuple(p.shape)}")
        if not torch.all((mask == 0) | (mask == 1)):
            raise InvalidValue(f"mask for {name!r} must contain only 0 and 1")
        resolved[p] = mask.detach().clone()
    return resolved


def _poisson_loader(dataset: ArrayDataset, sample_rate: float, steps: int, generator: torch.Generator) -> DataLoader:
    """Opacus's Poisson loader at ``sample_rate`` for exactly ``steps`` batches an epoch (its
    default, int(1/q), is one short for some q = 1/k in floating point, e.g. k = 93).

    A rank holding no examples still takes every step (pure noise on its part): whether a
    shard is empty depends on the records, so it must not stop the run."""
    if len(dataset.x) != len(dataset.y):
        raise InvalidValue(f"dataset needs matching x and y (got {len(dataset.x)} and {len(dataset.y)})")
    x, y = row_major(torch.as_tensor(dataset.x, dtype=torch.float32)), torch.as_tensor(dataset.y, dtype=torch.long)
    empty = len(y) == 0
    if empty:  # Opacus reads the batch shapes from the first example: a zero row that is never sampled
        x, y = torch.zeros((1, *x.shape[1:])), torch.zeros(1, dtype=torch.long)
    loader = DPDataLoader(TensorDataset(x, y), sample_rate=sample_rate, generator=generator)
    loader.batch_sampler.steps = steps
    if empty:
        loader.batch_sampler.num_samples = 0
    return loader


def train_dp(
    model: nn.Module,
    dataset: ArrayDataset,
    config: DPSGDConfig,
    noise: NoiseSource,
    masks: dict[str, torch.Tensor] | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
    progress: bool = False,
    num_examples: int | None = None,
    secure_group: SecureGroup | None = None,
) -> DPTrainResult:
    """Train ``model`` in place with DP-SGD on ``dataset`` (``.x`` float32 [n, ...], ``.y`` int64).

    Only parameters with ``requires_grad=True`` train; ``masks`` (parameter name → 0/1
    tensor of the parameter's shape) restrict training further, element by element.
    Poisson sampling and noise come from ``noise``. ``on_epoch(epoch, epsilon)`` is called
    after every epoch with the ε spent so far.

    ``num_examples``: the size N the schedule is computed from (rate q = 1/⌈N/B⌉, ⌈N/B⌉ steps
    per epoch). It must be fixed before the data is read — a size the owners declared —
    because the number of steps is released; default ``len(dataset)``, for public-sized splits.
    The examples actually held are each sampled at rate q whatever their number.

    ``secure_group``: this process is one rank of a ``torch.distributed`` group whose rank r
    belongs to owner ``secure_group.owners[r]``, each rank holding a disjoint part of the N examples.
    Every rank Poisson-samples ITS examples at the same q for the same number of steps, so the
    union of the batches is a Poisson sample of the union; the clipped sums are added up by
    secure aggregation with distributed Skellam noise (``learning.secure_dpsgd``), and every
    rank applies the same noised total divided by qN: central DP-SGD on the union, no rank
    seeing another's clean sum, charged as the Poisson-subsampled Skellam mechanism. Each step
    computes on a batch padded to one public size (``secure_dpsgd.PaddedPoissonBatches``), so
    when this rank reaches the all-reduce does not tell the others its batch; ``num_examples``
    sets that size.
    """
    masks = masks or {}
    resolved_masks = _check_masks(model, masks)
    if config.grad_sample_mode in ("ghost", "bk") and resolved_masks:
        raise InvalidValue(f"masks need per-example gradients before clipping: use grad_sample_mode 'hooks', "
                         f"not {config.grad_sample_mode!r}")
    data_parallel = secure_group is not None
    if data_parallel and config.grad_sample_mode not in ("auto", "hooks"):
        raise InvalidValue("data-parallel DP-SGD runs with grad_sample_mode 'hooks'")
    schedule = dp_schedule(len(dataset.y) if num_examples is None else num_examples, config, secure=data_parallel)
    sample_rate, sigma = schedule.sample_rate, schedule.noise_multiplier
    loader = _poisson_loader(dataset, sample_rate, schedule.steps // config.epochs, torch_generator(noise))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mode = config.grad_sample_mode
    if mode == "auto":  # the masked and data-parallel optimizers are built on the hooks
        # (and Opacus's physical batch splitting is tested with them only). Reproducible noise
        # asks for the same weights every run: modes agree to rounding only, so no timing picks.
        plain = not (resolved_masks or data_parallel or config.max_physical_batch_size is not None)
        candidates = PROBED if plain and noise.secure else ("hooks",)
        # At the batch it will train with: which mode wins changes with it (cache sizes).
        probe_batch = min(max(1, round(sample_rate * schedule.num_examples)), 512)
        mode = fastest_mode(model, dataset.x.shape[1:], probe_batch, candidates, device)
    padded = None
    if data_parallel:  # every step of this rank on a batch of one public size (module secure_dpsgd, Timing)
        padded = PaddedPoissonBatches(
            torch.as_tensor(dataset.x, dtype=torch.float32), torch.as_tensor(dataset.y, dtype=torch.long),
            sample_rate, schedule.steps // config.epochs, schedule.num_examples,
            torch_generator(noise), config.max_physical_batch_size)
    model.to(device).train()  # Opacus refuses a module in eval mode (e.g. right after evaluation)
    # Groups by parameter name, so before a data-parallel wrapper prefixes the names.
    optimizer = torch.optim.SGD(param_groups(model, config), lr=config.lr, momentum=config.momentum)
    if data_parallel:
        broadcast_parameters(model)  # every rank starts from rank 0's weights
    engine = privacy_engine()
    # Opacus divides by its own guess from the examples held here; the sum (across owners: the
    # secure sum of every rank's) is divided by the declared expected batch, a public constant.
    expected_batch = sample_rate * schedule.num_examples
    optimizer_class: Callable[..., DPOptimizer] = FiniteDPOptimizer
    if data_parallel:  # the noise step becomes a round of the secure sum
        aggregation = SecureAggregation(secure_group.owners, trainable_entries(model, masks))
        optimizer_class = functools.partial(
            SecureSumDPOptimizer, group=secure_group, aggregation=aggregation,
            plan=aggregation.plan(config.max_grad_norm, sigma, schedule.num_examples, schedule.steps), noise=noise,
            session="conclave-dpsgd", masks=resolved_masks)
    elif resolved_masks:
        optimizer_class = functools.partial(MaskedDPOptimizer, masks=resolved_masks)
    # The noise is drawn where the gradients live; batches are sampled on the CPU. The loader is
    # already Poisson: Opacus takes its rate as 1/len(loader) = q.
    made = clipped(engine, model, optimizer, loader, mode, noise_multiplier=sigma, max_grad_norm=config.max_grad_norm,
                   expected_batch_size=expected_batch, sample_rate=sample_rate,
                   generator=torch_generator(noise, device), optimizer_class=optimizer_class)
    private_model, dp_optimizer, criterion, private_loader = made.module, made.optimizer, made.loss, made.loader
    dp_optimizer.secure_mode = True  # floating-point-safe noise (see the module docstring)
    # The σ Opacus draws with: σ, except in an audit's deliberately broken build (test-only
    # ``NoisePolicy.noise_scale``, read here alone), which must still be accounted, and is charged, at σ.
    if noise.noise_scale != 1.0 and data_parallel:
        raise InvalidValue("a noise_scale other than 1 acts on Opacus's Gaussian noise, not on the secure sum's")
    drawn = sigma * noise.noise_scale
    dp_optimizer.noise_multiplier = drawn
    steps = 0
    account = dp_optimizer.step_hook
    scheduler = lr_scheduler(dp_optimizer.original_optimizer, config, schedule.steps)

    def count_step(optimizer: DPOptimizer) -> None:
        # Called once per logical (noised) step, never for a physical chunk of one.
        nonlocal steps
        steps += 1
        optimizer.noise_multiplier = sigma  # what Opacus's accountant reads: the σ charged
        account(optimizer)
        optimizer.noise_multiplier = drawn

    dp_optimizer.attach_step_hook(count_step)
    if config.max_physical_batch_size is not None and padded is None:
        private_loader = wrap_data_loader(
            data_loader=private_loader, max_batch_size=config.max_physical_batch_size, optimizer=dp_optimizer
        )

    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    epsilons: list[float] = []
    epochs = tqdm(range(config.epochs), desc="DP-SGD", disable=not progress)

    def step_padded(chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """One logical step on a padded batch: its chunks accumulate, the last one steps."""
        for i, (x, y, weight) in enumerate(chunks):
            dp_optimizer.zero_grad()
            if i < len(chunks) - 1:
                dp_optimizer.signal_skip_step(True)
            # Opacus scales a mean loss's per-example gradients by the rows: each row's is weight × its own.
            losses = F.cross_entropy(private_model(x.to(device)), y.to(device), reduction="none")
            (finite_losses(losses) * weight.to(device)).mean().backward()
            taken = steps
            dp_optimizer.step()
            if steps > taken:
                scheduler.step()

    def step_loaded(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One step (or one physical chunk of a split one) on the loader's Poisson batch."""
        x, y = batch[0].to(device), batch[1].to(device)
        dp_optimizer.zero_grad()
        # An empty Poisson batch still takes a (pure noise) step: skipping it would
        # reveal that the batch was empty, and the accountant counts every step.
        if len(y):
            criterion(private_model(x), y).backward()
        elif mode == "ew":  # expanded weights refuse a batch of 0: no per-example gradients
            for parameter in trainable:
                parameter.grad_sample = parameter.new_zeros((0, *parameter.shape))
        elif mode == "bk":  # the clipped sum of no examples
            for parameter in trainable:
                parameter.grad = torch.zeros_like(parameter)
        else:
            (private_model(x).sum() * 0.0).backward()
        taken = steps
        dp_optimizer.step()
        if steps > taken:  # a logical step, not one physical chunk of a split batch
            scheduler.step()

    batches, take_step = (padded, step_padded) if padded is not None else (private_loader, step_loaded)
    for epoch in epochs:
        private_model.train()
        for batch in batches:
            take_step(batch)
        if not data_parallel:
            epsilons.append(float(engine.get_epsilon(config.delta)))
        else:  # Opacus's accountant knows only the Gaussian
            spent = schedule.charge_after(steps, "")
            epsilons.append(epsilon_from_rdp(spent.orders, spent.rdp, config.delta)[0])
        epochs.set_postfix(eps=f"{epsilons[-1]:.3f}")
        log.info("DP-SGD epoch %d: ε %.4f (δ=%g)", epoch + 1, epsilons[-1], config.delta)
        if on_epoch is not None:
            on_epoch(epoch, epsilons[-1])

    history_steps = sum(n for _, _, n in engine.accountant.history)
    if not history_steps == steps == schedule.steps:
        raise RuntimeError(f"accountant saw {history_steps} steps, {steps} were taken, {schedule.steps} planned")
    made.close()  # every hook off ``model``
    for p in model.parameters():
        p.grad = None
    return DPTrainResult(
        model=model,
        epsilons=epsilons,
        noise_multiplier=float(sigma),
        sample_rate=float(sample_rate),
        steps=steps,
        charge=schedule.charge,
        schedule=schedule,
    )
