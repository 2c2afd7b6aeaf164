"""``pipeline: sparse_finetune``: the YAML adapter over ``cluster.sparse_finetuning`` (sparse DP
fine-tuning, Luo et al. 2021). It runs ``finetune_sparsely`` and writes ``metrics.json`` and
``privacy.json``."""
from __future__ import annotations

from conclave.cluster.pipelines import RunContext, RunOutcome
from conclave.cluster.run_privacy import admitting_owners
from conclave.cluster.sparse_finetuning import Config, finetune_sparsely, planned_work, validate
from conclave.privacy.accounting.owner_ledger import RunRequest

__all__ = ["Config", "planned_work", "run", "unused_settings", "validate"]


def unused_settings(config: Config) -> tuple[str, ...]:
    """The keys this run does not read: beside owners, the benchmark's private split; without
    owners, the owners' sections."""
    return ("private",) if config.owners else ("owners", "test", "classes")


def run(config: Config, context: RunContext) -> RunOutcome:
    planned = planned_work(config)  # every variant's schedule: every owner must pay for all of them first
    with admitting_owners(config, RunRequest(context.run_name, "sparse_finetune", ("dpsgd",)), planned, planned,
                          context.ray_address):
        result = finetune_sparsely(config, context.results, context.ray_address)
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
    return RunOutcome(summary, metrics, privacy)
