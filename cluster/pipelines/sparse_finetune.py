"""``pipeline: sparse_finetune``: the pipeline over ``cluster.sparse_finetuning`` (sparse DP
fine-tuning, Luo et al. 2021). It runs ``finetune_sparsely`` and writes ``metrics.json`` and
``privacy.json``; a sweep pre-trains once (``pretrain``) and runs each trial with ``trial``. Owners
named by their gateway admit each variant there, by their own policies (``cluster.sparse_gateways``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

from conclave.cluster.pipelines import OwnersData, Pipeline, RunContext, RunOutcome
from conclave.cluster.run_privacy import admitting_owners
from conclave.cluster.results import RunDirectory
from conclave.cluster.sparse_finetuning import (
    PublicPretraining, SparseConfig, SparseResult, finetune_sparsely, planned_work, pretrain, validate,
)
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.owner_policy import RunRequest


@dataclass(frozen=True)
class SparseFinetune(Pipeline[SparseConfig, SparseResult]):
    """``pipeline: sparse_finetune``: a public model, DP-fine-tuned sparsely on the owners' data."""

    name: ClassVar[str] = "sparse_finetune"
    config_type: ClassVar[type] = SparseConfig
    config: SparseConfig

    def plan(self) -> PrivacyCharge:
        """Behind gateways, the owners declare their records there: each gateway is asked (``Describe``)."""
        config = self.config
        if config.through_gateways:
            from conclave.cluster.active_gateways import declared_records

            return planned_work(config, declared_records(config.owners, config.gateways))
        return planned_work(config)

    def unused_settings(self) -> tuple[str, ...]:
        """The keys this run does not read: beside owners, the benchmark's private split (behind
        gateways also how Opacus would batch: a gateway computes its per-example gradients itself);
        without owners, the owners' sections."""
        if self.config.through_gateways:
            return ("private", "finetune.grad_sample_mode", "finetune.max_physical_batch_size")
        return ("private",) if self.config.owners else ("owners", "test", "classes")

    def validate(self) -> SparseFinetune:
        return self.with_config(validate(self.config))

    def owners_data(self) -> OwnersData:
        """Its owners and test data; no pool (its public data is a benchmark's), no teachers."""
        config = self.config
        return OwnersData(config.owners, None, config.test, config.classes, {})

    def run(self, context: RunContext) -> RunOutcome[SparseResult]:
        return self._run(context, None, every_epoch=False)

    def pretrain(self, results: RunDirectory) -> PublicPretraining:
        """The public model the variants fine-tune, pre-trained into ``results.path/pretrain``
        (resumed from there): public data only, nothing charged."""
        return pretrain(self.config, results.path / "pretrain")

    def trial(self, context: RunContext, public: PublicPretraining) -> RunOutcome[SparseResult]:
        """One sweep trial: a run, admitted and charged by the owners as ``run`` is, that
        fine-tunes ``public`` (pre-trained once for the sweep) and evaluates each variant after
        every epoch too (``variants[v]["accuracies"]``)."""
        return self._run(context, public, every_epoch=True)

    def _run(self, context: RunContext, public: PublicPretraining | None,
             every_epoch: bool) -> RunOutcome[SparseResult]:
        config = self.config
        planned = self.plan()  # every variant's schedule: every owner must pay for all of them first
        # Owners behind gateways admit each variant there, each by its own policy (``GatewayDpsgd``).
        admitted = contextlib.nullcontext() if config.through_gateways else admitting_owners(
            config, RunRequest(context.run_name, self.name, ("dpsgd",)), planned, planned, context.ray_address)
        with admitted:
            result = finetune_sparsely(config, context.results, context.ray_address, public, every_epoch)
        variants, privacy, public_accuracy = result.variants, result.privacy, result.public_accuracy
        metrics = {
            "public": {"losses": result.public_losses, "accuracy": result.public_accuracy,
                       "dataset": result.public_dataset},
            "private_test": result.private_test, "variants": result.variants,
            "shards": {"nodes": result.nodes},  # owner → the Ray nodes its shard actors ran on
        }
        context.results.write_json("metrics", metrics)
        context.results.write_json("privacy", privacy.as_dict())
        summary = {f"accuracy[{v}]": round(r["accuracy"], 4) for v, r in variants.items()}
        summary["public_accuracy"] = round(public_accuracy, 4)
        summary["guarantee (all variants)"] = privacy.headline()
        if privacy.owners:
            summary["owners (lifetime budgets)"] = privacy.owners_line()
        return RunOutcome(result, privacy, metrics, summary)
