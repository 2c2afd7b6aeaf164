"""The one-run audit of the ``active_learning`` pipeline's DP-SGD (Steinke, Nasr & Jagielski,
NeurIPS 2023): canaries in, one training run through the pipeline's own shard actors, a
membership guess per canary from the released model, and the lower bound on ε.

The audit is a run of its own, charged to a temporary run ledger; only the final DP-SGD checkpoint
is scored. Its canaries go into the private records, so it audits a config of the benchmark
(``data``): owners keep theirs behind their gateways. docs/privacy.md, "The one-run audit".
"""
from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conclave.cluster.active_learning import ActiveLearningConfig, public_side, shard_plans
from conclave.cluster.auditing import AuditResult, AuditSettings, SecretInclusion
from conclave.cluster.run_privacy import dp_sgd_trust
from conclave.errors import InvalidValue
from conclave.learning.data import Dataset
from conclave.privacy.accounting.audit import epsilon_lower_bound
from conclave.privacy.noise import SECURE

log = logging.getLogger(__name__)

PIPELINE = "active_learning"
METHOD = ("DP-SGD of active_learning, one run: canaries are test-split records resampled coordinate by "
          "coordinate with uniformly random labels, each added to {holder} with probability 1/2; "
          "score = -loss of the final DP-SGD checkpoint on (canary, label); the r/2 lowest losses are "
          "guessed in, the r/2 highest out")


def default_guesses(canaries: int) -> int:
    """r when the settings give none: a fifth of the canaries (an even count, at least 2 when
    m allows): the guesses the released model is surest of, where a weak signal shows first."""
    return min(canaries, max(2, 2 * (canaries // 10)))


@dataclass(frozen=True)
class CanaryRecords:
    """m canary records in the model's representation: public, known to the auditor."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, rows: np.ndarray) -> CanaryRecords:
        return CanaryRecords(self.x[rows], self.y[rows])


def make_canaries(test: Dataset, count: int, rng: np.random.Generator) -> CanaryRecords:
    """``count`` canaries from the public ``test`` split: every coordinate (pixel, feature or
    column) of a canary is that coordinate of an independently chosen test record, and its
    label is uniform over the classes.

    Why this kind: each value is one real records take, so a canary is in range for any
    representation (images, features, tables) without knowing it, yet the combination looks
    like no real record, so the model has no class to prefer for it: left out, its loss is
    that of a guess; put in, it is memorised without the rest of the data pulling it back,
    which gives the loss score more power than a mislabelled real record (its true class is
    learnt from its neighbours) and more than uniform noise on tables."""
    if len(test) < 1:
        raise InvalidValue("the audit makes its canaries from the test split, and it is empty")
    flat = test.x.reshape(len(test), -1)
    picks = rng.integers(0, len(test), size=(count, flat.shape[1]))
    x = np.take_along_axis(flat, picks, axis=0).reshape(count, *test.x.shape[1:]).astype(np.float32)
    return CanaryRecords(x, rng.integers(0, test.num_classes, size=count).astype(np.int64))


@dataclass(frozen=True)
class CanarySource:
    """A shard actor's source with the included canaries added to what it holds."""

    inner: object  # the shard actor's own ShardSource (picklable)
    canaries: CanaryRecords = field(repr=False)

    @property
    def owner(self) -> str:
        return self.inner.owner

    def load(self, shard_ids: Sequence[int]) -> Dataset:
        held = self.inner.load(shard_ids)
        return Dataset(np.concatenate([held.x, self.canaries.x.astype(held.x.dtype)]),
                       np.concatenate([held.y, self.canaries.y]), held.num_classes, f"{held.name}+canaries",
                       held.features)


def membership_scores(model, canaries: CanaryRecords, batch: int = 512) -> np.ndarray:
    """−loss of each canary's (input, label) under the released ``model``: higher means "in"."""
    import torch
    from torch.nn import functional

    model.eval()
    scores = []
    with torch.no_grad():
        for start in range(0, len(canaries), batch):
            x = torch.as_tensor(canaries.x[start:start + batch])
            y = torch.as_tensor(canaries.y[start:start + batch])
            scores.append(-functional.cross_entropy(model(x), y, reduction="none").numpy())
    return np.concatenate(scores)


def guesses_from(scores: np.ndarray, count: int) -> np.ndarray:
    """+1 for the ⌈count/2⌉ highest scores, −1 for the ⌊count/2⌋ lowest, 0 (abstain) elsewhere."""
    order = np.argsort(-scores, kind="stable")
    guesses = np.zeros(len(scores), dtype=np.int64)
    inside = (count + 1) // 2
    guesses[order[:inside]] = 1
    guesses[order[len(scores) - (count - inside):]] = -1
    return guesses


def audit(config: ActiveLearningConfig, settings: AuditSettings) -> AuditResult:
    """The one-run audit of ``config``'s DP-SGD (module docstring)."""
    from conclave.actors.dp_trainer import ShardGroup, ShardPlan
    from conclave.cluster.config import ConfigError
    from conclave.cluster.ray_runtime import start_ray
    from conclave.learning.dp_schedule import dp_schedule

    m = settings.canaries
    r = default_guesses(m) if settings.guesses is None else settings.guesses
    if config.owners:
        raise ConfigError("audit: it plants canaries in the owners' records, which stay behind their gateways: "
                          "audit a config of the benchmark (its data section)")
    if m < 1 or not 1 <= r <= m:
        raise InvalidValue(f"an audit needs canaries >= 1 and 1 <= guesses <= canaries, got {m} and {r}")
    if config.checkpoints_from is not None:
        raise InvalidValue("checkpoints_from: an audit trains its own DP-SGD run with the canaries; remove it")
    if settings.broken_noise is not None and config.secure_training:
        raise InvalidValue("broken_noise scales Opacus's Gaussian noise; this config trains through the secure sum")
    run_name = f"{config.name}-audit"
    policy = config.privacy.noise
    if settings.broken_noise is not None:
        policy = dataclasses.replace(policy, noise_scale=settings.broken_noise)
    unsound = (policy.unsound_reason,) if policy.unsound_reason else ()

    declared = config.private_size + m  # the schedule covers the canaries too
    start_ray(None, runtime_env=config.runtime_env, models=config.models)
    public = public_side(config, np.random.default_rng(config.seed))
    spec = public.model_spec(config)
    canaries = make_canaries(public.test, m, SECURE.source("audit-canaries").rng)
    inclusion = SecretInclusion(m)
    plans = shard_plans(config)
    holder = plans[0]
    plans[0] = ShardPlan(CanarySource(holder.source, canaries.subset(inclusion.members(np.arange(m)))), holder.shard_ids)

    dp = config.dpsgd.dp_config(config.privacy.delta)
    schedule = dp_schedule(declared, dp, secure=config.secure_training)
    dp = dataclasses.replace(dp, noise_multiplier=schedule.noise_multiplier, target_epsilon=None)
    with tempfile.TemporaryDirectory(prefix="conclave-audit-") as folder:
        ledger = config.privacy.open_ledger(Path(folder) / "ledger.sqlite", schedule.charge)
        group = None
        try:
            group = ShardGroup(plans, spec, config.torch_threads, num_cpus=config.dpsgd.cpus_per_worker,
                               input_shape=spec.input_shape)
            if group.secure != schedule.secure:
                raise RuntimeError("the shard actors' way of summing differs from what the ledger is charged for")
            ledger.charge(schedule.charge)
            log.info("audit of DP-SGD: %d canaries, q=%.5f σ=%.3f %d epochs over %d shard actor(s)", m,
                     schedule.sample_rate, schedule.noise_multiplier, dp.epochs, len(group.actors))
            released = group.train(dp, policy, declared)[-1]
            if released.sample_rate != schedule.sample_rate or released.steps != schedule.steps:
                raise RuntimeError("the trainer's sampling differs from what the ledger was charged for")
            report = config.privacy.report(schedule.charge, ledger, dp_sgd_trust(config.secure_training))
        finally:
            if group is not None:
                group.shutdown()
            ledger.close()

    # Guesses from the released model alone; the inclusion draw is read only after.
    guesses = guesses_from(membership_scores(released.load_into(spec.build()), canaries), r)
    correct = inclusion.correct(guesses)
    guarantee = report.guarantee.marked(unsound)
    bound = epsilon_lower_bound(m, r, correct, guarantee.delta, settings.confidence)
    return AuditResult(PIPELINE, run_name, bound, guarantee, m, r, correct, METHOD.format(holder="the private split"),
                       unsound)
