"""Private active learning's DP-SGD at the owners' gateways (``owners: [{name, gateway}]`` with ``gateways:``).

The schedule follows from the records the gateways declare (``Describe``, public), as across shard
actors: q = 1/⌈N/B⌉, ⌈N/B⌉ steps an epoch, charged as the secure sum's subsampled Skellam.
``GatewayDpsgd`` admits it at every gateway (each owner's policy admits the whole schedule); each step
is then charged in every owner's ledger, on its machine, before its masked share leaves. The
coordinator holds the model, steps its optimizer on each decoded noised total and keeps one
checkpoint per epoch; its run ledger, its view, is charged the whole schedule before the first step.
No owner's file is named or read here.
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from conclave.actors.owners import OwnerDropout
from conclave.cluster.owners import DataOwner, GatewaysConfig
from conclave.learning.data.sources import PublicReading

if TYPE_CHECKING:
    from conclave.actors.dp_trainer import DPCheckpoint, ModelSpec
    from conclave.cluster.gateway.client import CoordinatorTls
    from conclave.privacy.accounting.ledger import Ledger

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


def gateway_checkpoints(config: Any, spec: ModelSpec, classes: Sequence[str],
                        reading: PublicReading, records: int, ledger: Ledger) -> tuple[list[DPCheckpoint], dict]:
    """DP-SGD through the owners' gateways on the schedule of ``records`` (their declared records),
    for ``config``, the ``ActiveLearningConfig`` of the run (``cluster.active_learning`` calls this):
    one checkpoint per epoch, and the figures ``privacy.json`` reports (each owner's spend as its
    gateway said it after the last step)."""
    import torch
    from tqdm.auto import tqdm

    from conclave.actors.dp_trainer import DPCheckpoint
    from conclave.cluster.gateway.client import OwnerGateway
    from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd
    from conclave.cluster.gateway.identity import Verifier
    from conclave.learning.dp_schedule import dp_schedule, dp_step_charge
    from conclave.learning.dpsgd import lr_scheduler, param_groups
    from conclave.privacy.accounting.guarantee import worst_case_guarantee
    from conclave.progress import COUNTS

    dp, delta, files = config.dpsgd, config.privacy.delta, config.gateways
    dp_config = dp.dp_config(delta)
    schedule = dp_schedule(records, dp_config, secure=True)
    q, z = schedule.sample_rate, schedule.noise_multiplier
    terms = DpsgdTerms(spec.name, dp.max_grad_norm, z, q, schedule.steps, config.seed)
    tls = coordinator_tls(files)
    run = GatewayDpsgd([OwnerGateway(owner.gateway, tls) for owner in config.owners], Verifier(tls.ca),
                       f"{config.name}-{secrets.token_hex(4)}", terms, classes, lifetime_epsilon=files.lifetime_epsilon,
                       reading=reading, standardiser=spec.standardiser)
    try:
        names = tuple(owner.name for owner in config.owners)
        if run.owners != names or run.records != records:
            raise OwnerDropout(f"the gateways now describe owners {list(run.owners)} with {run.records} records, not "
                               f"{list(names)} with {records} as planned: the run is aborted before its first step")
        ledger.charge(schedule.charge)  # the coordinator's view; each owner's ledger is charged step by step
        log.info("DP-SGD through %d gateways: q=%.5f σ=%.3f %d epochs", len(names), q, z, dp.epochs)
        model = spec.build()
        optimizer = torch.optim.SGD(param_groups(model, dp_config), lr=dp.lr, momentum=dp.momentum)
        scheduler = lr_scheduler(optimizer, dp_config, schedule.steps)
        per_epoch, checkpoints = schedule.steps // dp.epochs, []
        for epoch in tqdm(range(1, dp.epochs + 1), desc="DP-SGD", unit="epochs", bar_format=COUNTS):
            for _ in range(per_epoch):
                run.step(model, optimizer)
                scheduler.step()
            steps = per_epoch * epoch
            epsilon = worst_case_guarantee(dp_step_charge(q, z, steps, "dpsgd", True), delta).epsilon
            state = {key: value.detach().cpu().numpy().copy() for key, value in model.state_dict().items()}
            checkpoints.append(DPCheckpoint(epoch, float(epsilon), delta, q, z, steps, state, secure=True))
        spend: dict[str, Any] = {owner: {"epsilon_spent": s.epsilon_spent, "charges": s.charges}
                                 for owner, s in run.spend.items()}
    finally:
        run.shutdown()
    return checkpoints, {"sample_rate": q, "noise_multiplier": z, "epochs": dp.epochs, "declared_private_size": records,
                         "gateways": len(names), "owners_at_gateways": spend}
