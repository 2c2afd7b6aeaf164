"""Sparse DP fine-tuning at the owners' gateways (``owners: [{name, gateway}]`` with ``gateways:``).

Each variant is one DP-SGD run admitted at every gateway (``GatewayDpsgd`` with ``SparseTerms``): the
public pre-trained weights with the new classifier and the variant's public mask travel once, at
admission, and each owner's policy admits the variant's whole schedule as pipeline
``sparse_finetune``. Each step is then charged in every owner's ledger, on its machine, before its
masked share of the trained entries' clipped gradient sum leaves. The schedule follows from the
records the gateways declare (``Describe``), as across shard actors: q = 1/⌈N/B⌉, ⌈N/B⌉ steps an
epoch, charged as the secure sum's subsampled Skellam. The coordinator holds the model, steps its
optimizer on each decoded noised total and keeps one checkpoint per epoch. No owner's file is named
or read here.
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

from conclave.actors.dp_trainer import DPCheckpoint
from conclave.actors.owners import OwnerDropout
from conclave.actors.sparse_trainer import SparseVariant
from conclave.cluster.active_gateways import coordinator_tls
from conclave.learning.data.sources import PublicReading
from conclave.learning.dp_schedule import DPSGDConfig, dp_schedule
from conclave.privacy.noise import NoisePolicy

log = logging.getLogger(__name__)


class GatewayVariants:
    """The owners' gateways of ``config`` (a ``SparseConfig``) as ``finetune_sparsely`` uses shard
    actors otherwise (``actors.dp_trainer.ShardGroup``): ``train`` fine-tunes one variant through them,
    classifying ``classes``, the owners' data read as ``reading``."""

    secure = True  # every step is a secure sum of the gateways' shares

    def __init__(self, config: Any, classes: Sequence[str], reading: PublicReading) -> None:
        self._config, self._classes, self._reading = config, tuple(classes), reading
        self.spend: dict[str, dict[str, Any]] = {}  # each owner's lifetime ledger after the latest step

    def train(self, dp_config: DPSGDConfig, noise: NoisePolicy, records: int, recipe: SparseVariant,
              progress: bool = True) -> list[DPCheckpoint]:
        """``recipe`` DP-fine-tuned through the gateways on the schedule of ``records`` (those they
        declare): one checkpoint per epoch. ``noise`` must be sound: the gateways draw theirs from OS
        entropy, and nothing else."""
        import torch

        from conclave.cluster.gateway.client import OwnerGateway
        from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd, SparseTerms
        from conclave.cluster.gateway.identity import Verifier
        from conclave.learning.dpsgd import lr_scheduler, param_groups

        config, files = self._config, self._config.gateways
        if not noise.sound:
            raise ValueError(f"the gateways draw their noise from OS entropy only: {noise.unsound_reason()}")
        model, plan = recipe.planned()
        schedule = dp_schedule(records, dp_config, secure=True)
        terms = DpsgdTerms(recipe.public.name, dp_config.max_grad_norm, schedule.noise_multiplier,
                           schedule.sample_rate, schedule.steps, config.seed,
                           arguments=tuple(recipe.public.kwargs.items()), sparse=SparseTerms.of(model, plan.masks))
        tls = coordinator_tls(files)
        run = GatewayDpsgd([OwnerGateway(owner.gateway, tls) for owner in config.owners], Verifier(tls.ca),
                           f"{config.name}-{recipe.variant}-{secrets.token_hex(4)}", terms, self._classes,
                           lifetime_epsilon=files.lifetime_epsilon, reading=self._reading)
        try:
            names = tuple(owner.name for owner in config.owners)
            if run.owners != names or run.records != records:
                raise OwnerDropout(f"the gateways now describe owners {list(run.owners)} with {run.records} records, "
                                   f"not {list(names)} with {records} as planned: the run is aborted before its "
                                   "first step")
            log.info("variant %s through %d gateways: d=%d q=%.5f σ=%.3f %d epochs", recipe.variant, len(names),
                     plan.trained_entries, schedule.sample_rate, schedule.noise_multiplier, dp_config.epochs)
            optimizer = torch.optim.SGD(param_groups(model, dp_config), lr=dp_config.lr, momentum=dp_config.momentum)
            checkpoints = run.checkpoints(model, optimizer, lr_scheduler(optimizer, dp_config, schedule.steps),
                                          dp_config.epochs, dp_config.delta, progress)
        finally:
            self.spend = {owner: {"epsilon_spent": s.epsilon_spent, "charges": s.charges}
                          for owner, s in run.spend.items()}
            run.shutdown()
        return checkpoints

    @property
    def placement(self) -> dict[str, list[str]]:
        """None of the coordinator's Ray nodes holds an owner's records: each owner's work runs on its own."""
        return {}

    def __enter__(self) -> GatewayVariants:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # each variant's channels close with its run
