"""Private active learning's DP-SGD at the owners' gateways (``owners: [{name, gateway}]`` with ``gateways:``, or
those a run starts on this machine for owners named by their data: ``cluster.gateway.local``).

The schedule follows from the records the gateways declare (``Describe``, public), as across shard
actors: q = 1/⌈N/B⌉, ⌈N/B⌉ steps an epoch, charged as the secure sum's subsampled Skellam.
``GatewayDpsgd`` admits it at every gateway (each owner's policy admits the whole schedule); each step
is then charged in every owner's ledger, on its machine, before its masked share leaves. The
coordinator holds the model, steps its optimizer on each decoded noised total and keeps one
checkpoint per epoch; its run ledger, its view, is charged the whole schedule before the first step.
NearPrivate's DP-PCA and support counts, when the run asks for them, are admitted with the steps and
released through the same gateways after them (``GatewayOwners.support``). No owner's file is named or
read here.

DP column screening (``dpsgd.screen_steps``, tables): before the steps, a second run of the same
``conclave run`` — logistic regression for the screening steps at the same q and σ, admitted and
charged like the steps — and the columns whose weights it learnt largest are the only ones the model
then reads (``Standardiser.keep``). Choosing them from its DP model is post-processing; its steps are
in the run's planned work and guarantee (``DPSchedule.screen_steps``), and in every checkpoint's ε.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from conclave.actors.owners import OwnerDropout
from conclave.cluster.owners import DataOwner, GatewaysConfig
from conclave.learning.data.sources import PublicReading

if TYPE_CHECKING:
    from conclave.actors.dp_trainer import DPCheckpoint, ModelSpec
    from conclave.cluster.gateway.client import CoordinatorTls
    from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd, GatewaySupport
    from conclave.cluster.run_privacy import GatewayAccount
    from conclave.learning.data.schema import Standardiser
    from conclave.learning.dp_schedule import DPSchedule
    from conclave.privacy.accounting.ledger import ChargeGate, Ledger

log = logging.getLogger(__name__)


def coordinator_tls(files: GatewaysConfig) -> CoordinatorTls:
    from conclave.cluster.gateway.client import CoordinatorTls

    return CoordinatorTls(Path(files.certificate), Path(files.key), Path(files.ca))


def declared_records(owners: Sequence[DataOwner], files: GatewaysConfig) -> int:
    """The records the owners' gateways declare, all together (each gateway must be its owner's)."""
    from conclave.cluster.gateway.client import OwnerGateway

    tls, total = coordinator_tls(files), 0
    for owner in owners:
        gateway = OwnerGateway(owner.gateway, tls)
        try:
            description = gateway.describe()
        except grpc.RpcError as err:
            raise OwnerDropout(f"owner {owner.name}'s gateway at {owner.gateway} did not describe itself: "
                               f"{err.code().name}: {err.details()}") from None
        finally:
            gateway.close()
        if description.owner != owner.name:
            raise OwnerDropout(f"the gateway at {owner.gateway} is owner {description.owner[:40]!r}'s, not owner "
                               f"{owner.name}'s: nothing was asked of it")
        total += int(description.records)
    return total


class GatewayOwners:
    """The owners' side of a run of ``config`` (an ``ActiveLearningConfig``) through their gateways, as
    ``cluster.active_learning`` uses its shard actors otherwise: ``train`` the DP-SGD checkpoints on
    the schedule of ``records`` (their declared records), then NearPrivate's ``support`` under one of
    them. The run is admitted at every gateway when it trains, NearPrivate's releases with it.
    ``budget_sources``: where each owner's budget comes from, where the run knows it (gateways it
    started on this machine)."""

    def __init__(self, config: Any, spec: ModelSpec, classes: Sequence[str], reading: PublicReading,
                 records: int, budget_sources: Mapping[str, str] | None = None) -> None:
        self._config, self._spec, self._classes, self._reading, self._records = config, spec, classes, reading, records
        self._budget_sources = budget_sources or {}
        self._run: GatewayDpsgd | None = None
        self._charges_before: dict[str, int] | None = None  # each owner's, when the run was first admitted

    def train(self, ledger: Ledger) -> tuple[list[DPCheckpoint], dict]:
        """One checkpoint per epoch, and the DP-SGD figures ``privacy.json`` reports (each owner's account:
        ``accounts``). With ``dpsgd.screen_steps``, a screening run first picks the columns the model reads."""
        import torch
        from tqdm.auto import tqdm

        from conclave.actors.dp_trainer import DPCheckpoint
        from conclave.cluster.gateway.dpsgd_client import DpsgdTerms
        from conclave.cluster.gateway.near_private import NearPrivateReleases
        from conclave.learning.dp_schedule import dp_schedule
        from conclave.learning.dpsgd import lr_scheduler, param_groups
        from conclave.privacy.accounting.guarantee import worst_case_guarantee
        from conclave.progress import COUNTS

        config, records = self._config, self._records
        dp, delta = config.dpsgd, config.privacy.delta
        dp_config = dp.dp_config(delta)
        schedule = dp_schedule(records, dp_config, secure=True, screen_steps=dp.screen_steps)
        q, z = schedule.sample_rate, schedule.noise_multiplier
        name = f"{config.name}-{secrets.token_hex(4)}"
        figures: dict = {}
        if schedule.screen_steps:
            keep = self._screen(schedule, f"{name}-screen", ledger)
            self._spec = dataclasses.replace(self._spec, standardiser=self._spec.standardiser.keeping(keep))
            figures["screened_columns"] = [int(i) for i in np.flatnonzero(keep)]  # public: post-processing
        spec = self._spec
        releases = config.selection_releases()
        terms = DpsgdTerms(spec.name, dp.max_grad_norm, z, q, schedule.steps, config.seed,
                           NearPrivateReleases(*releases) if releases else None)
        self._run = run = self._admitted(name, terms, spec.standardiser)
        ledger.charge(schedule.charge)  # the coordinator's view; each owner's ledger is charged step by step
        log.info("DP-SGD through %d gateways: q=%.5f σ=%.3f %d epochs", len(run.owners), q, z, dp.epochs)
        model = spec.build()
        optimizer = torch.optim.SGD(param_groups(model, dp_config), lr=dp.lr, momentum=dp.momentum)
        scheduler = lr_scheduler(optimizer, dp_config, schedule.steps)
        per_epoch, checkpoints = schedule.steps // dp.epochs, []
        for epoch in tqdm(range(1, dp.epochs + 1), desc="DP-SGD", unit="epochs", bar_format=COUNTS):
            for _ in range(per_epoch):
                run.step(model, optimizer)
                scheduler.step()
            steps = per_epoch * epoch
            # the screening run's steps too: the model reads the columns it chose
            epsilon = worst_case_guarantee(schedule.charge_after(steps, "dpsgd"), delta).epsilon
            state = {key: value.detach().cpu().numpy().copy() for key, value in model.state_dict().items()}
            checkpoints.append(DPCheckpoint(epoch, float(epsilon), delta, q, z, steps, state, secure=True,
                                            screen_steps=schedule.screen_steps))
        return checkpoints, {"sample_rate": q, "noise_multiplier": z, "epochs": dp.epochs,
                             "declared_private_size": records, "gateways": len(run.owners),
                             **({"screen_steps": schedule.screen_steps} if schedule.screen_steps else {}), **figures}

    def _admitted(self, name: str, terms: DpsgdTerms, standardiser: Standardiser | None) -> GatewayDpsgd:
        """Run ``name`` admitted at every gateway, on the owners and records planned (else ``OwnerDropout``)."""
        from conclave.cluster.gateway.client import OwnerGateway
        from conclave.cluster.gateway.dpsgd_client import GatewayDpsgd
        from conclave.cluster.gateway.identity import Verifier

        config, files = self._config, self._config.gateways
        tls = coordinator_tls(files)
        run = GatewayDpsgd([OwnerGateway(owner.gateway, tls) for owner in config.owners], Verifier(tls.ca), name,
                           terms, self._classes, lifetime_epsilon=files.lifetime_epsilon, reading=self._reading,
                           standardiser=standardiser)
        names = tuple(owner.name for owner in config.owners)
        if run.owners != names or run.records != self._records:
            run.shutdown()
            raise OwnerDropout(f"the gateways now describe owners {list(run.owners)} with {run.records} records, not "
                               f"{list(names)} with {self._records} as planned: the run is aborted before its first "
                               "step")
        if self._charges_before is None:  # the run's first admission: the owners' accounts count from here
            self._charges_before = run.charges_before
        return run

    def _screen(self, schedule: DPSchedule, name: str, ledger: Ledger) -> np.ndarray:
        """DP column screening: ``SCREENING_MODEL`` trained through the gateways as its own admitted run
        ``name`` (the schedule's screening steps at its q and σ, each charged like the steps), then the
        columns its weights keep (``learning.models.table.kept_columns``: post-processing of a DP release)."""
        import torch
        from tqdm.auto import tqdm

        from conclave.cluster.gateway.dpsgd_client import DpsgdTerms
        from conclave.learning.dpsgd import lr_scheduler, param_groups
        from conclave.learning.models.table import SCREENING_MODEL, kept_columns
        from conclave.progress import COUNTS

        config, dp = self._config, self._config.dpsgd
        dp_config = dp.dp_config(config.privacy.delta)
        spec = dataclasses.replace(self._spec, name=SCREENING_MODEL)
        terms = DpsgdTerms(spec.name, dp.max_grad_norm, schedule.noise_multiplier, schedule.sample_rate,
                           schedule.screen_steps, config.seed)
        run = self._admitted(name, terms, spec.standardiser)
        try:
            ledger.charge(schedule.screen_charge)  # before its first step, as the steps' charge
            model = spec.build()
            optimizer = torch.optim.SGD(param_groups(model, dp_config), lr=dp.lr, momentum=dp.momentum)
            scheduler = lr_scheduler(optimizer, dp_config, schedule.screen_steps)
            for _ in tqdm(range(schedule.screen_steps), desc="DP screening", unit="steps", bar_format=COUNTS):
                run.step(model, optimizer)
                scheduler.step()
        finally:
            run.shutdown()
        keep = kept_columns(model.classifier.weight.detach().cpu().numpy(), dp.screen_keep)
        log.info("DP screening kept %d of %d columns (weight norm ≥ %g of the largest)", int(keep.sum()), len(keep),
                 dp.screen_keep)
        return keep

    @property
    def nodes(self) -> dict[str, list[str]]:
        """None of the coordinator's Ray nodes holds an owner's records: each owner's work runs on its own."""
        return {}

    def accounts(self) -> dict[str, GatewayAccount]:
        """Each owner's lifetime account as its gateway reports it now (none before the run is admitted)."""
        if self._run is None:
            return {}
        return self._run.accounts(self._budget_sources, self._charges_before)

    def support(self, checkpoint: DPCheckpoint, releases: Sequence, gate: ChargeGate) -> GatewaySupport:
        """NearPrivate's ``releases`` (the run's, admitted with it) under ``checkpoint``, charged to
        ``gate`` before each one's shares are asked."""
        from conclave.cluster.gateway.near_private import NearPrivateReleases
        from conclave.learning.training import embed

        if self._run is None or self._run.terms.near_private != NearPrivateReleases(*releases):
            raise RuntimeError("NearPrivate's releases differ from those the gateways admitted with the run")
        model = checkpoint.load_into(self._spec.build())
        dimension = int(embed(model, np.zeros((1, *self._spec.input_shape), dtype=np.float32)).shape[1])
        return self._run.support([p.detach().numpy() for p in model.parameters()], dimension, gate)

    def shutdown(self) -> None:
        if self._run is not None:
            self._run.shutdown()
