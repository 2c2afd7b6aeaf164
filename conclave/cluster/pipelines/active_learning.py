"""``pipeline: active_learning``: the pipeline over ``cluster.active_learning`` (private active
learning, Zhao et al. 2019). It runs ``learn_actively`` and writes ``metrics.json``,
``privacy.json`` and ``accuracy_vs_labels.png`` (what each holds: ``cluster.active_learning``).
A free sweep reuses one run's last DP checkpoint (``released_checkpoint``) and repeats only the
public phase on it (``improve_public``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from conclave.cluster.active_learning import (ActiveLearningConfig, ActiveLearningResult, improve, learn_actively,
                                              planned_work, public_side, validate)
from conclave.cluster.auditing import AuditResult, AuditSettings
from conclave.cluster.config import ConfigError
from conclave.cluster.pipelines import OwnersData, Pipeline, RunContext, RunOutcome, planned_on_declared
from conclave.cluster.results import RunDirectory
from conclave.privacy.accounting.charge import PrivacyCharge

if TYPE_CHECKING:
    from conclave.actors.dp_trainer import DPCheckpoint


@dataclass(frozen=True)
class ActiveLearning(Pipeline[ActiveLearningConfig, ActiveLearningResult]):
    """``pipeline: active_learning``: DP-SGD checkpoints on the owners' data, improved with bought labels."""

    name: ClassVar[str] = "active_learning"
    config_type: ClassVar[type] = ActiveLearningConfig
    config: ActiveLearningConfig

    def plan(self) -> PrivacyCharge:
        return planned_on_declared(self.config, planned_work)

    def unused_settings(self) -> tuple[str, ...]:
        """The keys this run does not read: beside owners, the benchmark's data keys
        (``data.public_size`` and ``data.features`` stay); without owners, the owners' sections."""
        if self.config.owners:
            return ("data.name", "data.root", "data.private_size", "data.num_shards", "data.pollution")
        return ("owners", "public", "test", "classes")

    def audit(self, settings: AuditSettings) -> AuditResult:
        """Canaries go into the private records, which owners keep behind their gateways."""
        if self.config.owners:
            raise ConfigError("audit: it plants canaries in the owners' records, which stay behind their gateways: "
                              "audit a config of the benchmark (its data section)")
        return super().audit(settings)

    def validate(self) -> ActiveLearning:
        return self.with_config(validate(self.config))

    def owners_data(self) -> OwnersData:
        config = self.config
        return OwnersData(config.owners, config.public, config.test, config.classes, {})

    def run(self, context: RunContext) -> RunOutcome[ActiveLearningResult]:
        config = self.config
        # Owners admit the run at their gateways, each by its own policy, which must pay for all of it first
        # (``GatewayDpsgd``).
        result = learn_actively(config, context.results, context.ray_address)
        checkpoint_rows, rows, privacy, sel = result.checkpoints, result.rows, result.privacy, config.selection
        context.results.write_json("privacy", privacy.as_dict())
        metrics = {"checkpoints": checkpoint_rows, "results": rows, "public_pool": result.public_pool,
                   "out_of_domain": result.out_of_domain, "labels_bought": result.labels_bought,
                   "shards": {"nodes": result.nodes}}  # owner → the Ray nodes its shard actors ran on
        context.results.write_json("metrics", metrics)
        final_epsilon = checkpoint_rows[-1]["epsilon"]
        if config.buys_labels:
            curves = {name: [r["accuracy"] for r in rows if r["strategy"] == name] for name in sel.strategies}
            curves[f"DP checkpoint (ε={final_epsilon:.2f})"] = [checkpoint_rows[-1]["test_accuracy"]] * len(sel.sizes)
            context.results.plot("accuracy_vs_labels", sorted(sel.sizes), curves, "N_labeled (public labels bought)",
                                 "test accuracy")
        summary = {"dp_checkpoint_accuracy": round(checkpoint_rows[-1]["test_accuracy"], 4),
                   "epsilon_dp": round(final_epsilon, 3), "guarantee": privacy.headline()}
        for name in sel.strategies:
            last = [r for r in rows if r["strategy"] == name][-1]
            summary[f"{name}@{last['n_labeled']}"] = f"{last['accuracy']:.4f} (ε={last['epsilon']:.2f})"
        if privacy.owners:
            summary["owners (lifetime budgets)"] = privacy.owners_line()
        return RunOutcome(result, privacy, metrics, summary)

    def released_checkpoint(self, results: RunDirectory) -> tuple[Path, DPCheckpoint]:
        """The last DP-SGD checkpoint a run into ``results`` saved (its file, and it loaded): a
        DP release, free to reuse."""
        from conclave.actors.dp_trainer import DPCheckpoint

        final = sorted((results.path / "checkpoints").glob("epoch-*.pt"))[-1]
        return final, DPCheckpoint.load(final)

    def improve_public(self, checkpoint: DPCheckpoint, out: Path) -> list[dict[str, Any]]:
        """The selection and fine-tuning phase alone, from ``checkpoint`` (a DP release), on the
        public side only: it gets no private source and no ledger (None), so a code path that
        tried to read private data or spend budget would fail instead of costing privacy.
        Returns its rows (one per strategy and label budget)."""
        import torch

        config = self.config
        torch.set_num_threads(config.torch_threads)
        rng = np.random.default_rng(config.seed)
        public = public_side(config, rng)  # the private part is dropped
        rows, _, _ = improve(config, [checkpoint], None, public.model_spec(config), None, public.pool_inputs,
                             public.annotator, public.out_of_domain, public.test, rng, out)
        return rows
