"""``conclave tune CONFIG``: run a Ray Tune sweep described by a YAML file (see configs/tune-*.yaml)."""
from __future__ import annotations

import argparse
import dataclasses

from conclave.cluster.api import ConfigError, TrackingFailed, add_flag, with_flag
from conclave.errors import fail


def add_arguments(parser: argparse.ArgumentParser, command: str = "tune") -> None:
    parser.add_argument("config", help="sweep YAML (kind, base run config, space; see configs/tune-*.yaml)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start one locally)")
    parser.add_argument("--results-dir", default="results", help="where results/<sweep>/ is written")
    parser.add_argument("--quiet", action="store_true", help="no Tune progress table while it runs")
    add_flag(parser)


def main(args: argparse.Namespace) -> int:
    from conclave.tuning.config import load_tune_config
    from conclave.tuning.sweep import check, run_sweep, summary_lines

    try:
        config = load_tune_config(args.config)
        config = dataclasses.replace(config, tracking=with_flag(config.tracking, args.mlflow))
        check(config)
    except ConfigError as err:
        return fail(err)
    try:
        result = run_sweep(config, args.results_dir, args.address, verbose=0 if args.quiet else 1)
    except TrackingFailed as err:
        return fail(err)
    print()
    for line in summary_lines(result):
        print(line)
    return 0
