"""``conclave run CONFIG`` and ``conclave demo``: load a config, run its pipeline, record it."""
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

log = logging.getLogger(__name__)

DEMO_CONFIG = {"pipeline": "teacher_student", "name": "demo"}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "run":
        parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start one locally)")
    parser.add_argument("--results-dir", default="results", help="where results/<run>/ is written")
    parser.add_argument("--run-name", default=None, help="name of the results folder (default: the config's name)")


def load_run_config(raw: dict) -> tuple[str, object]:
    """(pipeline name, its Config) from a parsed YAML mapping."""
    raw = dict(raw)
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
        pipeline, config = load_run_config(raw)
    except ConfigError as err:
        print(f"conclave: {err}", file=sys.stderr)
        return 2
    module = pipeline_module(pipeline)
    try:  # what the driver can check without Ray (its data, models): before anything is recorded
        config = module.validate(config) if hasattr(module, "validate") else config
    except ConfigError as err:
        print(f"conclave: {err}", file=sys.stderr)
        return 2
    run_name = args.run_name or getattr(config, "name", None) or Path(getattr(args, "config", "run")).stem
    results = RunDirectory(args.results_dir, run_name)
    results.write_json("config", {"pipeline": pipeline, **_as_dict(config)})
    from conclave.actors.owners import OwnerDataError, OwnerDropout  # here: torch and Ray load only for a run

    started = time.perf_counter()
    try:
        summary = module.run(config, RunContext(run_name, results, args.address)).summary
    except (ConfigError, OwnerDataError, PlacementError) as err:  # one line: the config's or an owner's data
        print(f"conclave: {err}", file=sys.stderr)
        return 2
    except OwnerDropout as err:  # after the start: one line, its own status
        print(f"conclave: {err}", file=sys.stderr)
        return 3
    elapsed = time.perf_counter() - started
    print(f"\n{pipeline} run '{run_name}' finished in {elapsed:.0f} s; results in {results.path}/")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    return 0


def _as_dict(config: object) -> dict:
    import dataclasses

    return dataclasses.asdict(config)  # type: ignore[arg-type]
