"""``pipeline: sparse_finetune``: the pipeline over ``cluster.sparse_finetuning`` (sparse DP
fine-tuning, Luo et al. 2021). It runs ``finetune_sparsely`` and writes ``metrics.json`` and
``privacy.json``; a sweep pre-trains once (``pretrain``) and runs each trial with ``trial``. Owners
admit each variant at their gateways (their own, or those the run starts on this machine for owners
named by their data), by their own policies (``cluster.sparse_gateways``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from conclave.cluster.pipelines import OwnersData, Pipeline, RunContext, RunOutcome, planned_on_declared
from conclave.cluster.results import RunDirectory
from conclave.cluster.sparse_finetuning import (
    PublicPretraining, SparseConfig, SparseResult, finetune_sparsely, planned_work, pretrain, validate,
)
from conclave.privacy.accounting.charge import PrivacyCharge


@dataclass(frozen=True)
class SparseFinetune(Pipeline[SparseConfig, SparseResult]):
    """``pipeline: sparse_finetune``: a public model, DP-fine-tuned sparsely on the owners' data."""

    name: ClassVar[str] = "sparse_finetune"
    config_type: ClassVar[type] = SparseConfig
    config: SparseConfig

    def plan(self) -> PrivacyCharge:
        return planned_on_declared(self.config, planned_work)

    def unused_settings(self) -> tuple[str, ...]:
        """The keys this run does not read: beside owners, the benchmark's private split and how Opacus
        would batch (a gateway computes its per-example gradients itself); without owners, the owners'
        sections."""
        if self.config.owners:
            return ("private", "finetune.grad_sample_mode", "finetune.max_physical_batch_size")
        return ("owners", "test", "classes")

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
        # Owners admit each variant at their gateways, each by its own policy (``GatewayVariants``).
        result = finetune_sparsely(self.config, context.results, context.ray_address, public, every_epoch)
        variants, privacy, public_accuracy = result.variants, result.privacy, result.public_accuracy
        metrics = {
            "public": {"losses": result.public_losses, "accuracy": result.public_accuracy,
                       "dataset": result.public_dataset},
            "private_test": result.private_test, "variants": result.variants,
            "shards": {"nodes": result.nodes},  # the benchmark's split → its shard actor's Ray node (owners: none)
        }
        context.results.write_json("metrics", metrics)
        context.results.write_json("privacy", privacy.as_dict())
        summary = {f"accuracy[{v}]": round(r["accuracy"], 4) for v, r in variants.items()}
        summary["public_accuracy"] = round(public_accuracy, 4)
        summary["guarantee (all variants)"] = privacy.headline()
        if privacy.owners:
            summary["owners (lifetime budgets)"] = privacy.owners_line()
        return RunOutcome(result, privacy, metrics, summary)
