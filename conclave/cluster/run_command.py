"""``conclave run CONFIG`` and ``conclave demo``: load a config, run its pipeline, record it.

Every failure is one line on stderr with its own exit status (``conclave.errors``: each kind of
failure's ``exit_code``; ``-v`` adds the traceback to the log), and a failed run leaves
``results/<run>/`` as it was (``RunDirectory.staged``).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import DEMO_CONFIG, RunContext, load_pipeline
from conclave.cluster.results import RunDirectory
from conclave.cluster.signal_hold import import_libraries
from conclave.cluster.tracking import MlflowLog, TrackingFailed, add_flag, from_section, with_flag
from conclave.errors import Interrupted, fail, failure, first_line
from conclave.privacy.accounting.ledger import LedgerDamaged, read_ledger

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "run":
        parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start one locally)")
    parser.add_argument("--results-dir", default="results", help="where results/<run>/ is written")
    parser.add_argument("--run-name", default=None, help="name of the results folder (default: the config's name)")
    add_flag(parser)


def main(args: argparse.Namespace) -> int:
    try:
        raw = DEMO_CONFIG if args.command == "demo" else load_yaml(args.config)
        tracking = with_flag(from_section(raw.get("tracking")), args.mlflow)
        pipeline = load_pipeline(raw)
        import_libraries()
        pipeline = pipeline.validate()  # what the driver can check without Ray (its data, models)
    except ConfigError as err:
        return fail(err)
    except KeyboardInterrupt:  # while loading: nothing ran, nothing to undo
        return fail(Interrupted("interrupted while loading; nothing ran"))
    run_name = args.run_name or pipeline.config.name or Path(args.config).stem  # (the demo is named)
    damaged = _damaged_ledger(Path(args.results_dir) / run_name)
    if damaged is not None:  # a durable ledger the run would charge: refused before Ray starts
        print(f"conclave: run '{run_name}' refused: {damaged}", file=sys.stderr)
        return LedgerDamaged.exit_code
    try:  # before the run starts: a store that cannot be reached fails before anything private is read
        tracker = MlflowLog(tracking, args.results_dir, run_name) if tracking.mlflow else None
    except TrackingFailed as err:
        return fail(err)
    except KeyboardInterrupt:  # while MLflow loads or reaches its store: still before the run
        return fail(Interrupted("interrupted while opening the tracking store; nothing ran"))
    started = time.time()  # the only time the run publishes: taken before anything private is read
    try:
        with RunDirectory.staged(args.results_dir, run_name) as results:
            results.write_json("config", pipeline.as_dict())
            summary = pipeline.run(RunContext(run_name, results, args.address)).summary
    except BaseException as err:  # noqa: BLE001 - every failure becomes one line and a status
        status, line = failure(err, run_name)
        log.debug("run '%s' failed", run_name, exc_info=True)
        print(f"conclave: {line}", file=sys.stderr)
        return status
    # No run time: it grows with the owners' records (docs/privacy.md, Timing).
    print(f"\n{pipeline.name} run '{run_name}' finished; results in {results.path}/")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    if tracker is not None:
        try:
            run_id = tracker.log_run(results.path, run_name, started, pipeline.unused_settings())
        except TrackingFailed as err:
            print(f"conclave: run '{run_name}' finished and its results are in {results.path}/, but {err}",
                  file=sys.stderr)
            return err.exit_code
        print(f"  mlflow: run {run_id} in experiment '{tracker.experiment}'")
    return 0


def _damaged_ledger(folder: Path) -> str | None:
    """The first line of what is wrong with a ledger kept in ``folder`` (its chain is checked
    without writing or locking), or None."""
    for ledger in sorted(folder.glob("*.sqlite")):
        try:
            read_ledger(ledger)
        except (OSError, ValueError) as err:
            return first_line(err)
    return None

