"""Sparse DP fine-tuning at the owners' gateways (``owners: [{name, gateway}]`` with ``gateways:``, or those a
run starts on this machine for owners named by their data: ``cluster.gateway.local``).

Each variant is one DP-SGD run admitted at every gateway (``GatewayDpsgd`` with ``SparseTerms``): the
public pre-trained weights with the new classifier and the variant's public mask travel once, at
admission, and each owner's policy admits the variant's whole schedule as pipeline
``sparse_finetune``. Once every gateway has admitted it, the run's ledger (its view) is charged that
schedule; each step is then charged in every owner's ledger, on its machine, before its masked share
of the trained entries' clipped gradient sum leaves. The schedule follows from the records the
gateways declare (``Describe``): q = 1/⌈N/B⌉, ⌈N/B⌉ steps an epoch, charged as the secure sum's
subsampled Skellam. The coordinator holds the model, steps its optimizer on each decoded noised total
and keeps one checkpoint per epoch. No owner's file is named or read here.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from conclave.actors.dp_trainer import DPCheckpoint
from conclave.actors.owners import OwnerDropout
from conclave.actors.sparse_trainer import SparseVariant
from conclave.cluster.active_gateways import coordinator_tls
from conclave.errors import InvalidValue
from conclave.learning.data.sources import PublicReading
from conclave.learning.dp_schedule import DPSchedule, DPSGDConfig

if TYPE_CHECKING:
    from conclave.cluster.run_privacy import GatewayAccount
    from conclave.privacy.accounting.ledger import Ledger

log = logging.getLogger(__name__)


class GatewayVariants:
    """The owners' gateways of ``config`` (a ``SparseConfig``) as the private side of its fine-tunings:
    ``train`` fine-tunes one variant through them, classifying ``classes``, the owners' data read as
    ``reading``. ``budget_sources``: where each owner's budget comes from, where the run knows it
    (gateways it started on this machine)."""

    def __init__(self, config: Any, classes: Sequence[str], reading: PublicReading,
                 budget_sources: Mapping[str, str] | None = None) -> None:
        self._config, self._classes, self._reading = config, tuple(classes), reading
        self._budget_sources = budget_sources or {}
        self._before: dict[str, int] | None = None  # each owner's ledger entries before the run's first variant
        self._accounts: dict[str, GatewayAccount] = {}

    def train(self, dp_config: DPSGDConfig, schedule: DPSchedule, recipe: SparseVariant, ledger: Ledger,
              progress: bool = True) -> list[DPCheckpoint]:
        """``recipe`` DP-fine-tuned through the gateways on ``schedule`` (the secure sum's, on the records
        they declare): one checkpoint per epoch. ``ledger``, the run's view, is charged the schedule once
        every gateway has admitted it, before the first step. The gateways draw their noise from OS
        entropy."""
        import torch

        from conclave.cluster.gateway.client import OwnerGateway
        from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd, SparseTerms
        from conclave.cluster.gateway.identity import Verifier
        from conclave.learning.dpsgd import lr_scheduler, param_groups

        config, files = self._config, self._config.gateways
        if not schedule.secure:
            raise InvalidValue("the gateways' steps are secure sums: charge their schedule as one")
        model, plan = recipe.planned()
        terms = DpsgdTerms(recipe.public.name, dp_config.max_grad_norm, schedule.noise_multiplier,
                           schedule.sample_rate, schedule.steps, config.seed,
                           arguments=tuple(recipe.public.kwargs.items()), sparse=SparseTerms.of(model, plan.masks))
        tls = coordinator_tls(files)
        run = GatewayDpsgd([OwnerGateway(owner.gateway, tls) for owner in config.owners], Verifier(tls.ca),
                           f"{config.name}-{recipe.variant}-{secrets.token_hex(4)}", terms, self._classes,
                           lifetime_epsilon=files.lifetime_epsilon, reading=self._reading)
        try:
            names, records = tuple(owner.name for owner in config.owners), schedule.num_examples
            if run.owners != names or run.records != records:
                raise OwnerDropout(f"the gateways now describe owners {list(run.owners)} with {run.records} records, "
                                   f"not {list(names)} with {records} as planned: the run is aborted before its "
                                   "first step")
            if self._before is None:
                self._before = dict(run.charges_before)
            ledger.charge(schedule.charge)  # the coordinator's view; each owner's ledger is charged step by step
            log.info("variant %s through %d gateways: d=%d q=%.5f σ=%.3f %d epochs", recipe.variant, len(names),
                     plan.trained_entries, schedule.sample_rate, schedule.noise_multiplier, dp_config.epochs)
            optimizer = torch.optim.SGD(param_groups(model, dp_config), lr=dp_config.lr, momentum=dp_config.momentum)
            checkpoints = run.checkpoints(model, optimizer, lr_scheduler(optimizer, dp_config, schedule.steps),
                                          dp_config.epochs, dp_config.delta, progress)
            self._accounts = run.accounts(self._budget_sources)
        finally:
            run.shutdown()
        return checkpoints

    @property
    def nodes(self) -> dict[str, list[str]]:
        """None of the coordinator's Ray nodes holds an owner's records: each owner's work runs on its own."""
        return {}

    def accounts(self) -> dict[str, GatewayAccount]:
        """Each owner's lifetime account as its gateway reported it after the last variant's last step, with
        the entries its ledger held before the run's first variant (none before a variant has trained)."""
        return {owner: dataclasses.replace(account, charges_before_run=self._before[owner])
                for owner, account in self._accounts.items()}

    def __enter__(self) -> GatewayVariants:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # each variant's channels close with its run
