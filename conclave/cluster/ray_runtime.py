"""Starting or joining Ray, with local traffic kept on loopback and no process left behind.

With an address we join that cluster; without one we start an embedded single-node cluster
bound to 127.0.0.1 (a bare ``ray.init()`` would join whatever ``/tmp/ray`` points to). Each
embedded start records the processes it started, and the next one stops those a killed driver
left, by PID and start time. Joining is bounded (``JOIN_TIMEOUT_S``, or
``$CONCLAVE_JOIN_TIMEOUT_S`` seconds) and fails in one line.
"""
from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import ray

from conclave.cluster.signal_hold import signals_held
from conclave.errors import ConclaveError, first_line
from conclave.learning.allocator import SETTINGS

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
JOIN_TIMEOUT_S = 30.0  # to reach a head's GCS and read its nodes: a command fails within a minute
JOIN_TIMEOUT_ENV = "CONCLAVE_JOIN_TIMEOUT_S"  # another wait, in seconds: a slow link, or a test's short one
START_WAIT_S = 180.0  # for an embedded node to register with its GCS (Ray's own wait: a fixed 30 s)
PROGRESS_EVERY_S = 10.0


class RayJoinFailed(ConclaveError):
    """The cluster at ``--address`` (or ``RAY_ADDRESS``) could not be joined."""

    exit_code = 5

    def run_line(self, run: str) -> str:
        return f"run '{run}' {self}"
_started_here = False  # whether this process started the Ray it uses (and so records its processes)


def keep_ray_on_loopback() -> None:
    """Make a Ray started from this process (and its children) listen on 127.0.0.1 only."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # inherited by Ray's processes
    ray_constants.ENABLE_RAY_CLUSTER = False  # already read at import time in this process


def start_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None,
              runtime_env: dict | None = None, models: Iterable[str | None] = ()) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``) if given, else start an embedded local cluster
    (after stopping what an earlier, killed driver left running). ``runtime_env``: Ray's, for every worker of this driver; the code of the users' ``models``
    that is not installed is added to it (``with_models``). Returns whether the Ray in use is
    the embedded one."""
    global _started_here
    if ray.is_initialized():
        return _started_here
    runtime_env = with_models(runtime_env or {}, models)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        with _progress(f"joining Ray cluster at {address}"):
            _match_head(address, join_timeout())
            ray.init(address=address, logging_level=logging.WARNING, runtime_env=_with_allocator(runtime_env or {}))
        return False
    keep_ray_on_loopback()
    kwargs: dict = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if temp_dir is not None:
        kwargs["_temp_dir"] = temp_dir
    if runtime_env:
        kwargs["runtime_env"] = dict(runtime_env)
    reclaim_orphaned_ray()
    # Ray runs its workers at niceness 15 by default: beside any ordinary process on the machine a
    # run's actors then starve (the suite beside one CPU-bound process ran several times slower and
    # its deadlines failed). An embedded Ray serves this run alone: its workers keep our priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ctrl-C waits until Ray has started and its processes are recorded, so the caller stops all
    # of them; SIGTERM is not held: Ray's processes inherit the mask, and stop on SIGTERM.
    with signals_held({signal.SIGINT}), _progress(f"starting embedded Ray on {LOOPBACK}"), \
            _patient_node_registration(START_WAIT_S):
        ray.init(address="local", **kwargs)
        _started_here = True
        record_ray_processes()
        atexit.register(_forget_record)
    return True


@contextmanager
def _progress(what: str, every: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Log ``what`` now, how long it has taken every ``every`` seconds, and when it is done."""
    log.info("%s", what)
    started = time.monotonic()
    done = threading.Event()

    def report() -> None:
        while not done.wait(every):
            log.info("%s: waited %.0f s so far", what, time.monotonic() - started)

    reporter = threading.Thread(target=report, name="ray-start-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
    log.info("%s: done in %.1f s", what, time.monotonic() - started)


@contextmanager
def _patient_node_registration(wait_s: float) -> Iterator[None]:
    """While Ray starts a node, its wait for the node to register with the GCS lasts ``wait_s``
    seconds instead of Ray's fixed 30 ("The current node timed out during startup", under load).
    Ray polls ``services.get_node`` until then and has no setting for it, so for the duration of
    the start each poll retries, until ``wait_s`` has passed, before it reports the node missing."""
    from ray._private import services

    original: Callable = services.get_node
    deadline = time.monotonic() + wait_s

    def get_node(gcs_address: str, node_id: str) -> dict:
        while True:
            try:
                return original(gcs_address, node_id)
            except RuntimeError:  # not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def join_timeout() -> float:
    """How long a join waits for the head: ``$CONCLAVE_JOIN_TIMEOUT_S`` seconds where set, else
    ``JOIN_TIMEOUT_S``."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV)
    if raw is None:
        return JOIN_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise RayJoinFailed(f"{JOIN_TIMEOUT_ENV} must be a positive number of seconds, not {raw!r}")
    return seconds


def _match_head(address: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Reach the GCS at ``address`` ("host:port"; others, such as "auto", are left to Ray) within
    ``timeout_s`` and set this driver up as the head's nodes are: raises ``RayJoinFailed``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    _enable_token_auth_if_token_exists()
    result: dict = {}

    def reach() -> None:
        try:
            result["nodes"] = _head_node_addresses(host, int(port), time.monotonic() + timeout_s)
        except Exception as err:  # noqa: BLE001 - reported by the caller, in one line
            result["error"] = err

    reacher = threading.Thread(target=reach, name="ray-join", daemon=True)  # Ray's client may block past it
    reacher.start()
    reacher.join(timeout_s)
    if "nodes" not in result:
        reason = first_line(result["error"]) if "error" in result else "no answer from its GCS"
        raise RayJoinFailed(f"could not join the Ray cluster at {address} within {timeout_s:.0f} s: {reason}")
    if (_is_loopback(host) and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
            and any(_is_loopback(node) for node in result["nodes"])):
        keep_ray_on_loopback()  # else Ray dials the machine's external address, where nothing listens


def _head_node_addresses(host: str, port: int, deadline: float) -> list[str]:
    """The addresses of the live nodes of the cluster whose GCS is at ``host:port``, once it
    accepts connections (retried until ``deadline``)."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                break
        except OSError as err:
            if time.monotonic() + 1 > deadline:
                raise ConnectionError(f"nothing accepts connections there ({err.strerror or err})") from err
            time.sleep(1)
    client = GcsClient(address=f"{host}:{port}")
    nodes = client.get_all_node_info(timeout=max(1.0, deadline - time.monotonic()),
                                     state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
    return [node.node_manager_address for node in nodes.values()]


def _enable_token_auth_if_token_exists() -> None:
    """Token auth, as ``ray start --head`` turns it on when a token exists and ``RAY_AUTH_MODE``
    is unset; Ray's driver does not for an address it is given, and then retries "InvalidAuthToken"."""
    from ray._raylet import AuthenticationTokenLoader, Config

    if "RAY_AUTH_MODE" in os.environ or not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray's configuration was read at import: read it again
    log.info("using Ray token authentication (RAY_AUTH_MODE=token), as a head started with a token does")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def with_models(runtime_env: dict, models: Iterable[str | None]) -> dict:
    """``runtime_env`` with the package folder (or module file) of each user's model factory
    that is not installed (``learning.models.user_source``: it lives under the working
    directory or another folder of the user's) added to ``py_modules``, so every worker, on any
    node, imports it as the driver does. The user's own ``py_modules`` come first and a folder
    they already name is not added twice. In a job submitted with ``ray job submit`` nothing is
    added: the job's own runtime_env (its ``working_dir``) carries the code, and Ray refuses a
    driver's ``py_modules`` beside the job's."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from conclave.learning.models.contract import user_source

    if RAY_JOB_CONFIG_JSON_ENV_VAR in os.environ:
        return dict(runtime_env)
    given = list(runtime_env.get("py_modules", []))
    named = {Path(entry).resolve() for entry in given if isinstance(entry, str) and "://" not in entry}
    added: list[str] = []
    for name in models:
        source = user_source(name) if name else None
        if source is not None and source not in named:
            named.add(source)
            added.append(str(source))
    if not added:
        return dict(runtime_env)
    log.info("shipping %s to Ray's workers (runtime_env py_modules)", ", ".join(added))
    return {**runtime_env, "py_modules": [*given, *added]}


def _with_allocator(runtime_env: dict) -> dict | None:
    """The cluster's workers were not started from this process's environment, so the
    allocator settings it holds (``learning.allocator``) travel in ``env_vars``; the user's
    own ``env_vars`` win."""
    settings = {name: os.environ[name] for name in SETTINGS if name in os.environ}
    if settings:
        runtime_env = {**runtime_env, "env_vars": {**settings, **runtime_env.get("env_vars", {})}}
    return runtime_env or None


def _records_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"conclave-ray-{os.getuid()}"


def _identity(process: psutil.Process) -> dict:
    return {"pid": process.pid, "create_time": process.create_time(), "name": process.name()}


def _same_process(record: dict) -> psutil.Process | None:
    """The live process ``record`` describes, or None (gone, a zombie holding nothing, or its
    PID now names another process)."""
    try:
        process = psutil.Process(record["pid"])
        same = abs(process.create_time() - record["create_time"]) < 0.01
        return process if same and process.status() != psutil.STATUS_ZOMBIE else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def record_ray_processes() -> None:
    """Write down the processes this driver's embedded Ray runs now (call again after it
    started more: actors' workers, agents); nothing when this process joined a cluster."""
    if not _started_here:
        return
    me = psutil.Process()
    children = []
    for child in me.children(recursive=True):
        try:
            children.append(_identity(child))
        except psutil.NoSuchProcess:
            continue
    directory = _records_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{me.pid}.json"
    path.with_suffix(".partial").write_text(json.dumps({"driver": _identity(me), "processes": children}))
    path.with_suffix(".partial").replace(path)


def stop_ray(wait: float = 5.0) -> list[int]:
    """Shut Ray down (or leave the cluster this process joined) and stop every process this one
    started that outlives the shutdown: Ray's agents may, the more so when a start was interrupted
    before Ray knew of them, and then hold ports for minutes. Only this process's own descendants,
    as listed before and after the shutdown (one reparented meanwhile is in the first list), each
    checked against its start time, so a reused PID is never touched. Returns the PIDs stopped."""
    before = _descendants()
    try:
        ray.shutdown()
    except Exception as err:  # a half-started Ray: what it started is stopped below all the same
        log.warning("Ray did not shut down cleanly (%s); stopping its processes", type(err).__name__)
    left = [process for process in {*before, *_descendants()} if _running(process)]
    _stop(left, wait)
    if left:
        log.info("stopped %d Ray processes that outlived its shutdown: PIDs %s", len(left), sorted(p.pid for p in left))
    _forget_record()
    return [process.pid for process in left]


def _stop(processes: list[psutil.Process], wait: float) -> None:
    """Terminate ``processes``, kill those still there after ``wait`` seconds, and wait for them."""
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, stubborn = psutil.wait_procs(processes, timeout=wait)
    for process in stubborn:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(stubborn, timeout=wait)


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _running(process: psutil.Process) -> bool:
    """Alive, and still the process it was (``is_running`` compares start times), not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _forget_record() -> None:
    (_records_dir() / f"{os.getpid()}.json").unlink(missing_ok=True)


def reclaim_orphaned_ray(wait: float = 5.0) -> list[int]:
    """Stop the Ray processes recorded by embedded starts whose driver is gone; returns their PIDs."""
    directory = _records_dir()
    stopped: list[int] = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _same_process(record["driver"]) is not None:
            continue  # its driver still runs: those processes are in use
        alive = [p for p in map(_same_process, record["processes"]) if p is not None]
        _stop(alive, wait)  # gone, ports released, before a new Ray starts
        if alive:
            log.warning("stopped %d Ray processes left running by an earlier embedded run (driver PID %d was "
                        "killed): PIDs %s", len(alive), record["driver"]["pid"], [p.pid for p in alive])
        stopped.extend(p.pid for p in alive)
        path.unlink(missing_ok=True)
    return stopped


def gpus_available() -> float:
    """GPUs the running cluster offers (0 on CPU-only machines)."""
    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else 0.0
