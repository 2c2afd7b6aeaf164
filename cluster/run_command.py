"""``conclave run CONFIG`` and ``conclave demo``: load a config, run its pipeline, record it.

Every failure is one line on stderr with its own exit status (``EXIT_CODES``; ``-v`` adds the
traceback to the log), and a failed run leaves ``results/<run>/`` as it was (``RunDirectory.staged``).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from conclave.actors.placement import PlacementError
from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.cluster.pipelines import RunContext, pipeline_module
from conclave.cluster.results import RunDirectory
from conclave.cluster.tracking import MlflowLog, TrackingFailed, add_flag, from_section, with_flag

log = logging.getLogger(__name__)

DEMO_CONFIG = {"pipeline": "teacher_student", "name": "demo"}

# One status per kind of failure, so scripts and job schedulers can tell them apart.
EXIT_CODES = {
    "failed": 1,        # anything else, after the start (one line; the traceback with -v)
    "config": 2,        # the config, an owner's data or placement: fix and run again
    "dropout": 3,       # an owner's actor left in the middle of a secure sum: nothing of the round released
    "budget": 4,        # the ledger refused a charge: the privacy budget does not cover the run
    "cluster": 5,       # Ray could not run an actor or a task (a node or worker died, out of resources)
    "tracking": 6,      # MLflow could not be reached (before the start) or refused the finished run's log
    "interrupted": 130, # Ctrl-C
}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "run":
        parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start one locally)")
    parser.add_argument("--results-dir", default="results", help="where results/<run>/ is written")
    parser.add_argument("--run-name", default=None, help="name of the results folder (default: the config's name)")
    add_flag(parser)


def load_run_config(raw: dict) -> tuple[str, object]:
    """(pipeline name, its Config) from a parsed YAML mapping. Its ``tracking`` section says how
    the run is recorded, not what it does: ``conclave.cluster.tracking.from_section`` reads it."""
    raw = dict(raw)
    raw.pop("tracking", None)
    name = raw.pop("pipeline", None)
    if name is None:
        raise ConfigError("config: missing required key 'pipeline'")
    try:
        module = pipeline_module(name)
    except KeyError as err:
        raise ConfigError(f"config.pipeline: {err.args[0]}") from err
    return name, from_dict(module.Config, raw)


def main(args: argparse.Namespace) -> int:
    try:
        raw = DEMO_CONFIG if args.command == "demo" else load_yaml(args.config)
        tracking = with_flag(from_section(raw.get("tracking")), args.mlflow)
        pipeline, config = load_run_config(raw)
    except ConfigError as err:
        print(f"conclave: {err}", file=sys.stderr)
        return 2
    module = pipeline_module(pipeline)
    try:  # what the driver can check without Ray (its data, models): before anything is recorded
        config = module.validate(config)
    except ConfigError as err:
        print(f"conclave: {err}", file=sys.stderr)
        return 2
    run_name = args.run_name or getattr(config, "name", None) or Path(getattr(args, "config", "run")).stem
    damaged = _damaged_ledger(Path(args.results_dir) / run_name)
    if damaged is not None:  # a durable ledger the run would charge: refused before Ray starts
        print(f"conclave: run '{run_name}' refused: {damaged}", file=sys.stderr)
        return 2
    try:  # before the run starts: a store that cannot be reached fails before anything private is read
        tracker = MlflowLog(tracking, args.results_dir, run_name) if tracking.mlflow else None
    except TrackingFailed as err:
        print(f"conclave: {err}", file=sys.stderr)
        return EXIT_CODES["tracking"]
    started = time.time()  # the only time the run publishes: taken before anything private is read
    try:
        with RunDirectory.staged(args.results_dir, run_name) as results:
            results.write_json("config", {"pipeline": pipeline, **_as_dict(config)})
            summary = module.run(config, RunContext(run_name, results, args.address)).summary
    except BaseException as err:  # noqa: BLE001 - every failure becomes one line and a status
        kind, line = failure(err, run_name)
        log.debug("run '%s' failed", run_name, exc_info=True)
        print(f"conclave: {line}", file=sys.stderr)
        return EXIT_CODES[kind]
    # No run time: it grows with the owners' records (docs/privacy.md, Timing).
    print(f"\n{pipeline} run '{run_name}' finished; results in {results.path}/")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    if tracker is not None:
        try:
            run_id = tracker.log_run(results.path, run_name, started, module.unused_settings(config))
        except TrackingFailed as err:
            print(f"conclave: run '{run_name}' finished and its results are in {results.path}/, but {err}",
                  file=sys.stderr)
            return EXIT_CODES["tracking"]
        print(f"  mlflow: run {run_id} in experiment '{tracker.experiment}'")
    return 0


def failure(err: BaseException, run_name: str) -> tuple[str, str]:
    """(kind in EXIT_CODES, one line) for an exception that ended a run."""
    import ray

    from conclave.actors.owners import OwnerDataError, OwnerDropout  # here: torch and Ray load only for a run
    from conclave.privacy.accounting.ledger import BudgetExceeded, LedgerDamaged, LedgerInUse
    from conclave.privacy.accounting.owner_ledger import OwnerRefused

    if isinstance(err, KeyboardInterrupt):
        return "interrupted", f"run '{run_name}' interrupted; its results folder is as it was"
    if isinstance(err, (ConfigError, OwnerDataError, PlacementError)):
        return "config", str(err)
    if isinstance(err, (LedgerDamaged, LedgerInUse, OwnerRefused)):
        return "config", f"run '{run_name}' refused: {_first_line(err)}"
    if isinstance(err, OwnerDropout):
        return "dropout", str(err)
    if isinstance(err, BudgetExceeded):
        line = _first_line(err)
        where = ("" if line.startswith("owner ") else
                 " (the ledger in its results folder keeps what earlier runs on the same data spent)")
        return "budget", f"run '{run_name}' refused by a privacy ledger: {line}{where}"
    if isinstance(err, ray.exceptions.RayError):
        return "cluster", f"run '{run_name}' lost a Ray actor or task: {type(err).__name__}: {_first_line(err)}"
    return "failed", f"run '{run_name}' failed: {type(err).__name__}: {_first_line(err)} (-v for the traceback)"


def _damaged_ledger(folder: Path) -> str | None:
    """The first line of what is wrong with a ledger kept in ``folder`` (its chain is checked
    without writing or locking), or None."""
    from conclave.privacy.accounting.ledger import read_ledger

    for ledger in sorted(folder.glob("*.sqlite")):
        try:
            read_ledger(ledger)
        except (OSError, ValueError) as err:
            return _first_line(err)
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _as_dict(config: object) -> dict:
    import dataclasses

    return dataclasses.asdict(config)  # type: ignore[arg-type]
