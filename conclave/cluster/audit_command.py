"""``conclave audit CONFIG``: an empirical lower bound on the config's ε from one run with canaries.

The audit is a run of its own ("<name>-audit": canaries never enter a production run; see
``cluster.auditing``) and writes ``results/<name>-audit/audit.json``. It prints one line: the
bound, its confidence and counts, the guarantee it sits under and the time taken. A config the
audit cannot take is one line on stderr and status 2; other failures are one line with
``conclave run``'s statuses.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from conclave.cluster.auditing import AUDITS, AuditSettings
from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.results import RunDirectory
from conclave.cluster.signal_hold import import_libraries
from conclave.errors import Interrupted, fail, failure

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("config", help="YAML config of the run to audit (see configs/)")
    parser.add_argument("--canaries", type=int, default=AuditSettings.canaries,
                        help="m: canary records, each included with probability 1/2 (default %(default)s)")
    parser.add_argument("--guesses", type=int, default=None,
                        help="r: membership guesses made, the rest abstain (default: the audit's own, m/5 for DP-SGD)")
    parser.add_argument("--confidence", type=float, default=AuditSettings.confidence,
                        help="confidence of the lower bound (default %(default)s)")
    parser.add_argument("--results-dir", default="results", help="where results/<run>-audit/ is written")
    parser.add_argument("--run-name", default=None,
                        help="name of the audited run (default: the config's name); the folder is <name>-audit")


def settings_of(args: argparse.Namespace) -> AuditSettings:
    """The audit's settings from the command line (``ConfigError``, one line, when out of range)."""
    if args.canaries < 1:
        raise ConfigError(f"--canaries must be >= 1, got {args.canaries}")
    if args.guesses is not None and not 1 <= args.guesses <= args.canaries:
        raise ConfigError(f"--guesses must be in [1, --canaries = {args.canaries}], got {args.guesses}")
    if not 0.0 < args.confidence < 1.0:
        raise ConfigError(f"--confidence must be in (0, 1), got {args.confidence}")
    return AuditSettings(canaries=args.canaries, guesses=args.guesses, confidence=args.confidence)


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_of(args)
        pipeline = load_pipeline(load_yaml(args.config))
        if pipeline.name not in AUDITS:
            raise ConfigError(f"config.pipeline: {pipeline.name!r} has no audit; audited pipelines: "
                              f"{', '.join(AUDITS.names)}")
        import_libraries()
        pipeline = pipeline.validate()
    except ConfigError as err:
        return fail(err)
    except KeyboardInterrupt:  # while loading: nothing ran, nothing to undo
        return fail(Interrupted("interrupted while loading; nothing ran"))
    if args.run_name:  # the audit run's name everywhere: its folder and the owners' ledgers
        pipeline = pipeline.with_config(dataclasses.replace(pipeline.config, name=args.run_name))
    run_name = f"{pipeline.config.name or Path(args.config).stem}-audit"
    try:
        result = pipeline.audit(settings)
    except ValueError as err:  # a setting the audit cannot take (checked before anything trains)
        return fail(ConfigError(f"audit '{run_name}': {str(err).strip().splitlines()[0]}"))
    except BaseException as err:  # noqa: BLE001 - every failure becomes one line and a status
        status, line = failure(err, run_name)
        log.debug("audit '%s' failed", run_name, exc_info=True)
        print(f"conclave: {line}", file=sys.stderr)
        return status
    with RunDirectory.staged(args.results_dir, run_name) as results:
        results.write_json("audit", result.as_dict())
    bound, guarantee = result.bound, result.guarantee
    print(f"audit: ε ≥ {bound.epsilon:.3f} at {bound.confidence:.0%} (m={bound.m}, r={bound.r}, v={bound.v}) "
          f"under guarantee ε = {guarantee.epsilon:.3f}")
    return 0
