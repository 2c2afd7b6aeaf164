"""Run one sweep: check it, prepare what trials share, run them with Ray Tune, account for
the tuning, and write the report.

Every check is made before anything runs (a ``ConfigError`` naming the problem). Random
repetition (Papernot & Steinke 2022, Thm 2) needs the number of trials to stay secret, so it is
drawn from OS entropy, Tune's output and storage are discarded, only the winner is written, and
every file gets one modification time. docs/cluster-and-tuning.md. Random repetition is refused
over owners: each trial charges every owner's ledger, so the ledgers would count the trials.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conclave.cluster.api import ConfigError, MlflowLog, Pipeline, RunDirectory, gpus_available, start_ray
from conclave.privacy.accounting.tuning_cost import TruncatedNegativeBinomial, sweep_cost
from conclave.tuning import report, spaces
from conclave.tuning.config import TuneConfig
from conclave.tuning.trainables import KINDS, TRIAL_MEMORY_BYTES, charge_from_fields, prepare, run_trial, trial_config

log = logging.getLogger(__name__)

_SEED_KEY = "privacy.insecure_noise_seed"


def check(config: TuneConfig) -> Pipeline:
    """Validate the sweep; returns the pipeline of one point of its space."""
    kind = KINDS[config.kind]
    if config.base.get("pipeline") != kind.pipeline:
        raise ConfigError(f"base.pipeline: a {config.kind} sweep runs the {kind.pipeline!r} pipeline, "
                          f"got {config.base.get('pipeline')!r}")
    try:
        _, preview = trial_config(config.kind, config.base, spaces.preview(config.space))
        preview.validate()  # its data and model, as `conclave run` checks them
    except ConfigError as err:
        raise ConfigError(f"base + space: {err}") from err
    swept = spaces.swept_keys(config.space)
    if _SEED_KEY in swept:
        raise ConfigError(f"space: {_SEED_KEY} cannot be swept: tuning draws noise from OS entropy only")
    try:
        preview.config.privacy.require_os_entropy("tuning")
    except ConfigError as err:
        raise ConfigError(f"base.{err}") from None
    if "tracking" in config.base:
        raise ConfigError("base.tracking: a sweep is logged by its own top-level tracking section")
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
        if preview.config.owners:
            raise ConfigError("cost.method: random-repetition keeps the number of trials secret, but every trial "
                              "charges each owner's ledger, which records it (use composition)")
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
    if not KINDS[config.kind].in_process:
        return {"cpu": 0, "memory": TRIAL_MEMORY_BYTES}
    gpu = config.resources.gpu if gpus_available() > 0 else 0.0
    return {"cpu": config.resources.cpu, "gpu": gpu}


def random_repetition(config: TuneConfig) -> bool:
    return config.cost.method == "random-repetition" and not KINDS[config.kind].free


def number_of_trials(config: TuneConfig, preview: Pipeline) -> tuple[int, TruncatedNegativeBinomial | None, int]:
    """(number of trials, K's distribution or None, the search's random state).

    ``num_samples`` and the config's seed, or for random repetition K drawn from the truncated
    negative binomial and a random state, both from the run's noise source — never logged."""
    if not random_repetition(config):
        return config.num_samples, None, config.seed
    distribution = TruncatedNegativeBinomial(config.cost.eta, config.cost.gamma)
    source = preview.config.privacy.noise.source("tuning-repetitions")
    return distribution.sample(source.rng), distribution, source.seed() % 2**32


def run_sweep(config: TuneConfig, results_root: str | Path = "results", address: str | None = None,
              verbose: int = 1) -> report.SweepResult:
    """Run the sweep on Ray (joined at ``address`` or started locally) and report it."""
    config = dataclasses.replace(config, base=absolute_roots(config.base))
    preview = check(config)
    kind = KINDS[config.kind]
    delta = preview.config.privacy.delta
    # before anything runs: an MLflow store that cannot be reached fails first
    tracker = MlflowLog(config.tracking, results_root, config.name) if config.tracking.mlflow else None
    start_ray(address, runtime_env=preview.config.runtime_env, models=preview.config.models)
    results = RunDirectory(results_root, config.name)
    prepared = prepare(config.kind, preview, results)
    before_trials = time.time()
    num_samples, distribution, search_state = number_of_trials(config, preview)
    hidden = distribution is not None  # K, and which trial won, must not leave
    parent = tracker.start_sweep(config.name) if tracker is not None and not hidden else None
    with tempfile.TemporaryDirectory(prefix="conclave-tune-") as scratch:
        storage = Path(scratch) if hidden else results.path / "ray"
        with _console_discarded() if hidden else contextlib.nullcontext():
            grid = _fit(config, kind, preview, prepared, num_samples, search_state, storage,
                        0 if hidden else verbose, [] if parent is None else [tracker.trial_callback(parent)])
        rows, finals = report.collect(grid, config.space)
    details: dict[str, Any] = {"delta": delta, "scheduler": config.scheduler.name}
    if hidden:
        # Theorem 2 covers publishing the winner's own output (its values, accuracy and reports:
        # fifo runs every trial to its end, so even how many reports it made is its own) — not
        # the other trials, their number or the winner's place among them.
        rows = report.published_winner(rows)
        details["repetitions"] = {"eta": distribution.eta, "gamma": distribution.gamma,
                                  "expected_trials": distribution.expected_trials(),
                                  "published": "the winner only; the number of trials is not published"}
    else:
        details["num_samples"] = num_samples
    if kind.free:
        cost = sweep_cost("free", delta, release_charge=prepared["charge"])
        details["release"] = {"what": "DP-SGD checkpoint trained once before the sweep",
                              "path": prepared["path"], "epsilon": prepared["epsilon"],
                              "accuracy": prepared["accuracy"]}
    else:
        charges = report.charges_of(finals, charge_from_fields)
        if charges is None:
            # A trial failed before reporting what it spent: nothing sound can be said.
            from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, unbounded_charge

            cost = sweep_cost("composition", delta, [unbounded_charge(
                "a trial failed before reporting its charge", orders=DEFAULT_ORDERS)])
        elif hidden:
            cost = sweep_cost("random-repetition", delta, charges, distribution=distribution)
        else:
            cost = sweep_cost("composition", delta, charges)
    result = report.write(results, config.name, config.kind, rows, cost, details, hidden=hidden)
    if hidden:
        _one_modification_time(results.path, before_trials)
    if tracker is not None:
        # (a random-repetition sweep draws K and its search state instead of num_samples and seed)
        unused = {"tracking", *(("num_samples", "seed") if hidden else ())}
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in unused}
        tracker.finish_sweep(results.path, config.name, settings, parent, at=before_trials if hidden else None)
    return result


@contextlib.contextmanager
def _console_discarded() -> Iterator[None]:
    """Drop everything Ray and Tune print while a random-repetition sweep runs: Tune prints the
    number of trials even at verbose=0 (Ray 2.60), its errors name trials by index, and a
    joined cluster forwards each trial's output. Prints and the log forwarder go to whatever
    ``sys.stdout``/``sys.stderr`` are at the time; Ray's log handler keeps the stream it was
    made with, so it is pointed at the sink too."""
    handlers = [h for h in logging.getLogger("ray").handlers if isinstance(h, logging.StreamHandler)]
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        streams = [h.setStream(sink) for h in handlers]
        try:
            yield
        finally:
            for handler, stream in zip(handlers, streams):
                if stream is not None:
                    handler.setStream(stream)


def _one_modification_time(folder: Path, when: float) -> None:
    """Give ``folder`` and everything in it the time ``when`` (taken before the trials):
    the gap between files written before and after the trials would tell how many ran."""
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (when, when))


def _fit(config: TuneConfig, kind, preview: Pipeline, prepared: Any, num_samples: int, search_state: int,
         storage: Path, verbose: int, callbacks: list):
    """Run the trials with Ray Tune (``callbacks``: its logger callbacks); returns its ``ResultGrid``."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

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
                                    search_alg=BasicVariantGenerator(random_state=search_state,
                                                                     max_concurrent=concurrent or 0)),
        run_config=tune.RunConfig(name=config.name, storage_path=str(storage.resolve()), verbose=verbose,
                                  callbacks=callbacks),
    )
    return tuner.fit()


def _max_reports(preview: Pipeline, kind: str) -> int:
    """How many reports a full trial makes (ASHA's max_t)."""
    if kind == "sparsity":
        return int(preview.config.finetune.epochs)
    return 1


def summary_lines(result: report.SweepResult) -> list[str]:
    """A short human summary of a finished sweep."""
    cost = result.cost
    count = "only the winner published" if result.hidden else f"{result.trials} trials, {result.failed} failed"
    lines = [f"sweep '{result.name}' ({result.kind}): {count}; results in {result.path}/"]
    best = result.best
    if best is not None:
        values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.values.items())
        lines.append(f"  best: {best.trial_id} ({values}) accuracy {best.accuracy:.4f}")
        lines.append(f"        ε of this trial alone {best.epsilon:.3g}; "
                     f"ε including the tuning {_eps(cost.epsilon)} at δ = {cost.delta:g}")
    tag = "FREE — " if cost.free else ""
    lines.append(f"  tuning cost: {tag}{cost.method}: {cost.statement}")
    return lines


def _eps(value: float) -> str:
    return "unbounded" if not math.isfinite(value) else f"{value:.3g}"
