"""Experiment tracking: what a run or a sweep published, logged to MLflow when asked.

MLflow gets what the results folder publishes and nothing else, so the rules that keep
``metrics.json`` free of private statistics are MLflow's too. A random-repetition sweep logs its
summary alone, as its number of trials is secret. Every timestamp is the run's start: its end
would time private work. By default SQLite at ``<results-dir>/mlflow.db``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from conclave.cluster.config import ConfigError, from_dict
from conclave.errors import ConclaveError, InvalidValue

INSTALL_HINT = "MLflow tracking needs mlflow-skinny: pip install 'conclave-ray[tracking]'"
ARTEFACT_SUFFIXES = (".json", ".csv", ".png")  # what a results folder publishes (not ledgers, not checkpoints)
# MLflow's limits on one log_batch call and on one param's value (mlflow.utils.validation).
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _PARAM_LENGTH = 100, 1000, 6000
_NOT_A_NAME_CHAR = re.compile(r"[^\w.\- ]")  # MLflow's name characters, less ':' (refused on Windows) and '/'


@dataclass(frozen=True)
class TrackingConfig:
    """A config's ``tracking`` section. ``mlflow``: log the run (or the sweep) to MLflow;
    ``tracking_uri``: where (default: SQLite at ``<results-dir>/mlflow.db``); ``experiment``:
    the MLflow experiment (default: the run's or the sweep's name)."""

    mlflow: bool = False
    tracking_uri: str | None = None
    experiment: str | None = None

    def __post_init__(self) -> None:
        if self.tracking_uri == "" or self.experiment == "":
            raise InvalidValue("tracking.tracking_uri and tracking.experiment must be non-empty or null")


class TrackingFailed(ConclaveError, RuntimeError):
    """MLflow could not be reached or refused what was logged (one line, the cause in ``__cause__``)."""

    exit_code = 6


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mlflow", nargs="?", const=True, default=None, metavar="URI",
                        help="log the results to MLflow, at URI if given (default: the config's "
                             "tracking.tracking_uri, else SQLite at RESULTS_DIR/mlflow.db)")


def from_section(section: Any, where: str = "config.tracking") -> TrackingConfig:
    """A run config's ``tracking`` section (absent: tracking off)."""
    if section is None:
        return TrackingConfig()
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a section (mapping), got {section!r}")
    return from_dict(TrackingConfig, section, where)


def with_flag(config: TrackingConfig, flag: bool | str | None) -> TrackingConfig:
    """``config`` overridden by ``--mlflow [URI]``; then MLflow must be importable (else
    ``ConfigError``: the run has not started)."""
    if flag is not None:
        config = dataclasses.replace(config, mlflow=True,
                                     tracking_uri=flag if isinstance(flag, str) else config.tracking_uri)
    if config.mlflow and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(INSTALL_HINT)
    return config


class MlflowLog:
    """One MLflow experiment at one tracking URI. Made before the work it records starts, so a
    store that cannot be reached fails before anything private is read, and so the experiment's
    creation time says nothing of how long that work took."""

    def __init__(self, config: TrackingConfig, results_root: str | Path, default_experiment: str) -> None:
        root = Path(results_root).resolve()
        self.uri = config.tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
        self.experiment = config.experiment or default_experiment
        scheme = urlparse(self.uri).scheme
        if scheme in ("", "file"):  # MLflow 3 refuses its file store unless opted in (see the module's docstring)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        artefacts = None  # the server's (or the file store's) own place
        if scheme == "sqlite":
            # Its artefacts beside the database (MLflow's default is ./mlruns, wherever the run starts).
            folder = Path(self.uri[len("sqlite:///"):]).resolve().parent
            folder.mkdir(parents=True, exist_ok=True)
            artefacts = (folder / "mlartifacts").as_uri()
            for name in ("mlflow.store.db.utils", "alembic"):  # its table creation, at INFO, on first use
                logging.getLogger(name).setLevel(logging.WARNING)
        with _failures(f"MLflow at {_shown(self.uri)}"):
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
            found = self.client.get_experiment_by_name(self.experiment)
            self.experiment_id = (found.experiment_id if found is not None
                                  else self.client.create_experiment(self.experiment, artifact_location=artefacts))

    def log_run(self, folder: Path, run_name: str, started: float, unused: Iterable[str] = ()) -> str:
        """Log a finished run's published folder as one MLflow run; returns its id. Every time in
        it is ``started``: when the run ended would tell how long its private work took.
        ``unused``: config keys the run did not read (its pipeline's ``unused_settings``), left out
        of the params (``config.json`` keeps them). Each owner's lifetime account becomes metrics
        ``owners.<name>.lifetime_epsilon``, ``.epsilon_spent`` and ``.charges``."""
        config = json.loads((folder / "config.json").read_text())
        metrics = json.loads((folder / "metrics.json").read_text())
        privacy = json.loads((folder / "privacy.json").read_text())
        guarantee = privacy["guarantee"]
        tags = {"conclave.kind": "run", "conclave.pipeline": str(config.get("pipeline")),
                "guarantee.basis": str(guarantee["basis"]), "guarantee.sound": str(bool(guarantee["sound"])).lower(),
                "guarantee.neighbouring": str(guarantee["neighbouring"])}
        if guarantee.get("unsound_reasons"):
            tags["guarantee.unsound_reasons"] = "; ".join(guarantee["unsound_reasons"])
        # (float(): JSON spells an unbounded ε "inf", see cluster.results)
        numbers = [*_numbers(metrics), ("guarantee.epsilon", float(guarantee["epsilon"]), 0),
                   ("guarantee.delta", float(guarantee["delta"]), 0)]
        for owner, account in privacy.get("owners", {}).items():
            numbers += [(_name(f"owners.{owner}.lifetime_epsilon"), float(account["guarantee"]["epsilon"]), 0),
                        (_name(f"owners.{owner}.epsilon_spent"), float(account["spent"]["epsilon"]), 0),
                        (_name(f"owners.{owner}.charges"), float(account["spent"]["charges"]), 0)]
        skipped = tuple(unused)
        params = {key: value for key, value in _params(config).items()
                  if not any(key == u or key.startswith(f"{u}.") for u in skipped)}
        with _failures(f"logging run '{run_name}' to MLflow at {_shown(self.uri)}"):
            run_id = self.client.create_run(self.experiment_id, start_time=_ms(started), run_name=run_name,
                                            tags=tags).info.run_id
            self._fill(run_id, folder, params, numbers, _ms(started))
            self.client.set_terminated(run_id, end_time=_ms(started))
        return run_id

    def start_sweep(self, name: str) -> str:
        """The summary run of a sweep that publishes every trial, made before its trials so
        they can name it as their parent; ``finish_sweep`` fills it."""
        with _failures(f"logging sweep '{name}' to MLflow at {_shown(self.uri)}"):
            return self.client.create_run(self.experiment_id, run_name=name,
                                          tags={"conclave.kind": "sweep"}).info.run_id

    def trial_callback(self, parent_run_id: str):
        """Ray Tune's callback that logs each trial (its values and reports) as a child run."""
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        return MLflowLoggerCallback(tracking_uri=self.uri, experiment_name=self.experiment,
                                    tags={"mlflow.parentRunId": parent_run_id, "conclave.kind": "trial"})

    def finish_sweep(self, folder: Path, name: str, settings: dict[str, Any], run_id: str | None = None,
                     at: float | None = None) -> str:
        """Log a finished sweep's published folder (``sweep.json`` and its files) with its public
        ``settings`` as params, into ``run_id`` (``start_sweep``) or a new run. ``at``: the one
        time every timestamp of the run gets (a random-repetition sweep: when its trials started)."""
        sweep = json.loads((folder / "sweep.json").read_text())
        cost = sweep["tuning_cost"]
        best = sweep.get("best") or {}
        params = {**_params(settings), **_params({"best": best.get("values", {})})}
        tags = {"conclave.kind": "sweep", "conclave.sweep_kind": str(sweep["kind"]),
                "guarantee.basis": str(cost["method"]), "guarantee.statement": str(cost["statement"])}
        numbers = [*_numbers(sweep), ("guarantee.epsilon", float(cost["epsilon"]), 0),
                   ("guarantee.delta", float(cost["delta"]), 0)]
        when = _ms(time.time() if at is None else at)
        with _failures(f"logging sweep '{name}' to MLflow at {_shown(self.uri)}"):
            if run_id is None:
                run_id = self.client.create_run(self.experiment_id, start_time=when, run_name=name).info.run_id
            self.client.log_batch(run_id, tags=_tags(tags))
            self._fill(run_id, folder, params, numbers, when)
            self.client.set_terminated(run_id, end_time=when)
            if at is not None:
                self._one_modification_time(run_id, at)
        return run_id

    def _fill(self, run_id: str, folder: Path, params: dict[str, str], numbers: list[tuple[str, float, int]],
              timestamp_ms: int) -> None:
        from mlflow.entities import Metric, Param

        items = list(params.items())
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + _PARAMS_PER_BATCH]])
        metrics = [Metric(key, value, timestamp_ms, step) for key, value, step in numbers]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i:i + _METRICS_PER_BATCH])
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix in ARTEFACT_SUFFIXES:
                self.client.log_artifact(run_id, str(path))

    def _one_modification_time(self, run_id: str, when: float) -> None:
        """The run's local files (a file store's run folder, or a SQLite store's artefacts) and
        their experiment's folder get ``when``: the times files were written tell when the sweep
        ended, and so how many trials it ran. Artefacts on a server: nothing here to set."""
        from mlflow.utils.file_utils import local_file_uri_to_path

        artefacts = self.client.get_run(run_id).info.artifact_uri
        if urlparse(artefacts).scheme not in ("", "file"):
            return
        run_dir = Path(local_file_uri_to_path(artefacts)).parent
        for path in [*run_dir.rglob("*"), run_dir, run_dir.parent]:
            os.utime(path, (when, when))


def _numbers(node: Any, key: str = "", step: int | None = None) -> Iterator[tuple[str, float, int]]:
    """(name, value, step) of every number in a JSON tree: keys joined with '.', a list's
    items as the steps of one series (a list inside a list has no second step: left out)."""
    if isinstance(node, bool) or node is None:
        return
    if isinstance(node, (int, float)):
        yield _name(key), float(node), step or 0
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{key}.{k}" if key else str(k), step)
    elif isinstance(node, list) and step is None:
        for i, item in enumerate(node):
            yield from _numbers(item, key, i)


def _params(node: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A config flattened to MLflow params (the whole of it is in ``config.json``: values over
    MLflow's length limit are cut there)."""
    params: dict[str, str] = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            params.update(_params(v, f"{key}."))
        else:
            params[_name(key)] = (v if isinstance(v, str) else json.dumps(v))[:_PARAM_LENGTH]
    return params


def _tags(tags: dict[str, str]):
    from mlflow.entities import RunTag

    return [RunTag(k, v) for k, v in tags.items()]


def _name(key: str) -> str:
    return _NOT_A_NAME_CHAR.sub("_", key)


def _ms(seconds: float) -> int:
    return int(math.floor(seconds * 1000))


def _shown(uri: str) -> str:
    """The URI without any user:password it carries."""
    parsed = urlparse(uri)
    if not parsed.password:
        return uri
    return parsed._replace(netloc=f"{parsed.hostname}{f':{parsed.port}' if parsed.port else ''}").geturl()


@contextlib.contextmanager
def _failures(doing: str) -> Iterator[None]:
    """Whatever MLflow raises becomes ``TrackingFailed`` naming what was being done."""
    try:
        yield
    except TrackingFailed:
        raise
    except Exception as err:  # noqa: BLE001 - MLflow's errors have no common base (HTTP, store, I/O)
        text = str(err).strip().splitlines()
        raise TrackingFailed(f"{doing}: {type(err).__name__}: {text[0][:300] if text else '(no message)'}") from err
