"""Run one sweep: check it, prepare what trials share, run them with Ray Tune, account for
the tuning, and write the report.

Checks made before anything runs (each a ``ConfigError`` naming the problem):
* the base config with one point of the space is a valid run config of the kind's pipeline;
* keys a kind prepares once (the public model, the fixed DP checkpoint) are not swept;
* ASHA only for kinds whose trials report every epoch;
* random repetition (Papernot & Steinke 2022, Thm 2) only with random search (no grid, no
  ASHA: trials must be independent runs of one algorithm) and with no privacy setting swept.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import ConfigError
from cluster.results import RunDirectory
from privacy.accounting.tuning_cost import TruncatedNegativeBinomial, sweep_cost
from tuning import report, spaces
from tuning.config import TuneConfig
from tuning.trainables import KINDS, TRIAL_MEMORY_BYTES, charge_from_fields, prepare, run_trial, trial_config

log = logging.getLogger(__name__)


def check(config: TuneConfig) -> Any:
    """Validate the sweep; returns the pipeline Config of one point of its space."""
    kind = KINDS[config.kind]
    if config.base.get("pipeline") != kind.pipeline:
        raise ConfigError(f"base.pipeline: a {config.kind} sweep runs the {kind.pipeline!r} pipeline, "
                          f"got {config.base.get('pipeline')!r}")
    try:
        _, preview = trial_config(config.kind, config.base, spaces.preview(config.space))
    except ConfigError as err:
        raise ConfigError(f"base + space: {err}") from err
    swept = spaces.swept_keys(config.space)
    fixed = [k for k in swept if k.startswith(kind.fixed_keys)] if kind.fixed_keys else []
    if fixed:
        raise ConfigError(f"space: {fixed} are prepared once for the whole {config.kind} sweep and cannot be swept")
    if config.scheduler.name == "asha" and not kind.per_epoch:
        raise ConfigError(f"scheduler.name: asha needs trials that report every epoch; {config.kind} trials "
                          "report when they finish (use fifo)")
    if config.cost.method == "random-repetition" and not kind.free:
        if kind.privacy_keys is None:
            raise ConfigError(f"cost.method: random-repetition needs trials with one fixed, data-independent "
                              f"charge; {config.kind} trials' charges differ (use composition)")
        if spaces.has_grid(config.space) or config.scheduler.name != "fifo":
            raise ConfigError("cost.method: random-repetition needs independent trials: random search only "
                              "(no grid) and the fifo scheduler")
        privacy = [k for k in swept if k.startswith(kind.privacy_keys)]
        if privacy:
            raise ConfigError(f"cost.method: random-repetition needs the same privacy cost in every trial, "
                              f"but {privacy} are swept (use composition)")
    return preview


def absolute_roots(node: Any) -> Any:
    """A copy of a run config with every relative data ``root`` made absolute: trials may run
    in another working directory (or on another node with the same layout)."""
    if isinstance(node, dict):
        return {k: (str(Path(v).resolve()) if k == "root" and isinstance(v, str) else absolute_roots(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [absolute_roots(v) for v in node]
    return node


def _resources(config: TuneConfig) -> dict[str, float]:
    from cluster.ray_runtime import gpus_available

    if not KINDS[config.kind].in_process:
        return {"cpu": 0, "memory": TRIAL_MEMORY_BYTES}
    gpu = config.resources.gpu if gpus_available() > 0 else 0.0
    return {"cpu": config.resources.cpu, "gpu": gpu}


def number_of_trials(config: TuneConfig) -> tuple[int, TruncatedNegativeBinomial | None]:
    """``num_samples``, or K drawn from the truncated negative binomial for random repetition."""
    if config.cost.method != "random-repetition" or KINDS[config.kind].free:
        return config.num_samples, None
    distribution = TruncatedNegativeBinomial(config.cost.eta, config.cost.gamma)
    drawn = distribution.sample(np.random.default_rng(config.seed))
    log.info("random repetition: K = %d trials drawn (E[K] = %.2f)", drawn, distribution.expected_trials())
    return drawn, distribution


def run_sweep(config: TuneConfig, results_root: str | Path = "results", address: str | None = None,
              verbose: int = 1) -> dict[str, Any]:
    """Run the sweep on Ray (joined at ``address`` or started locally) and report it."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    from cluster.ray_runtime import start_ray

    config = dataclasses.replace(config, base=absolute_roots(config.base))
    preview = check(config)
    kind = KINDS[config.kind]
    delta = preview.privacy.delta
    start_ray(address)
    results = RunDirectory(results_root, config.name)
    prepared = prepare(config.kind, preview, results)
    num_samples, distribution = number_of_trials(config)

    if config.scheduler.name == "asha":
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=_max_reports(preview, config.kind),
                                  grace_period=config.scheduler.grace_period,
                                  reduction_factor=config.scheduler.reduction_factor)
    else:
        scheduler = FIFOScheduler()
    # Pipeline-running kinds size their actors to the whole cluster: one trial at a time.
    concurrent = config.max_concurrent_trials or (None if kind.in_process else 1)
    trainable = tune.with_parameters(run_trial, kind=config.kind, base=config.base, space=config.space,
                                     prepared=prepared)
    tuner = tune.Tuner(
        tune.with_resources(trainable, _resources(config)),
        param_space=spaces.search_space(config.space),
        tune_config=tune.TuneConfig(metric="accuracy", mode="max", num_samples=num_samples, scheduler=scheduler,
                                    # (Tune ignores max_concurrent_trials when given a generator)
                                    search_alg=BasicVariantGenerator(random_state=config.seed,
                                                                     max_concurrent=concurrent or 0)),
        run_config=tune.RunConfig(name=config.name, storage_path=str((results.path / "ray").resolve()),
                                  verbose=verbose),
    )
    grid = tuner.fit()

    rows, finals = report.collect(grid, config.space)
    details: dict[str, Any] = {"delta": delta, "num_samples": num_samples,
                               "scheduler": config.scheduler.name}
    if kind.free:
        cost = sweep_cost("free", delta, release_charge=prepared["charge"])
        details["release"] = {"what": "DP-SGD checkpoint trained once before the sweep",
                              "path": prepared["path"], "epsilon": prepared["epsilon"],
                              "accuracy": prepared["accuracy"]}
    else:
        charges = report.charges_of(finals, charge_from_fields)
        if charges is None:
            # A trial failed before reporting what it spent: nothing sound can be said.
            from privacy.accounting.rdp import DEFAULT_ORDERS, unbounded_charge

            cost = sweep_cost("composition", delta, [unbounded_charge(
                "a trial failed before reporting its charge", orders=DEFAULT_ORDERS)])
        elif distribution is not None:
            cost = sweep_cost("random-repetition", delta, charges, distribution=distribution)
            # Theorem 2 covers publishing the winner only; the table and plot show every trial.
            table = sweep_cost("composition", delta, charges)
            details["repetitions"] = {"eta": distribution.eta, "gamma": distribution.gamma,
                                      "expected": distribution.expected_trials(), "drawn": num_samples,
                                      "epsilon_publishing_every_trial": table.epsilon}
        else:
            cost = sweep_cost("composition", delta, charges)
    summary = report.write(results, config.name, config.kind, rows, cost, details)
    summary["path"] = str(results.path)
    return summary


def _max_reports(preview: Any, kind: str) -> int:
    """How many reports a full trial makes (ASHA's max_t)."""
    if kind == "sparsity":
        return int(preview.finetune.epochs)
    return 1


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """A short human summary of a finished sweep."""
    cost = summary["tuning_cost"]
    lines = [f"sweep '{summary['name']}' ({summary['kind']}): {summary['trials']} trials, "
             f"{summary['failed']} failed; results in {summary['path']}/"]
    best = summary.get("best")
    if best:
        values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best["values"].items())
        lines.append(f"  best: {best['trial_id']} ({values}) accuracy {best['accuracy']:.4f}")
        lines.append(f"        ε of this trial alone {best['epsilon_trial']:.3g}; "
                     f"ε including the tuning {_eps(cost['epsilon'])} at δ = {cost['delta']:g}")
    tag = "FREE — " if cost["free"] else ""
    lines.append(f"  tuning cost: {tag}{cost['method']}: {cost['statement']}")
    repetitions = summary.get("repetitions")
    if repetitions:
        lines.append(f"  publishing every trial (trials.csv, the plot) costs the composition: "
                     f"ε = {_eps(repetitions['epsilon_publishing_every_trial'])}")
    return lines


def _eps(value: float) -> str:
    return "unbounded" if not math.isfinite(value) else f"{value:.3g}"
