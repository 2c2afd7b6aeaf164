"""Pipelines run as Ray jobs, and drivers joining a head with --address: a real head on 127.0.0.1
started as docs/cluster-and-tuning.md starts it, with its dashboard and the Jobs API; and the
cluster launcher config that `ray up` reads.

The head is a `ray start --head --block` child in its own process group, with its own temp
dir and free ports, so it never touches the session's embedded Ray (`ray stop` would stop
every Ray on the machine); stopping it means signalling the processes this module started.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.ray_heads import running_head

PROJECT_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180
JOB_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# what a shell that followed the docs has not set: the join must find them out itself
UNSET = ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return {**env, **extra}


@dataclass(frozen=True)
class Head:
    address: str  # the GCS, as --address takes it
    dashboard: str  # the Jobs API

    def client(self):
        """A JobSubmissionClient, once the dashboard answers."""
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return JobSubmissionClient(self.dashboard)
            except Exception as err:  # not up yet: connection refused or dashboard still starting
                if time.monotonic() > deadline:
                    raise AssertionError(f"dashboard never came up ({err!r})")
                time.sleep(1)


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A head started as docs/cluster-and-tuning.md starts it (loopback, dashboard for the Jobs
    API), on free ports and a temp dir of its own, from a shell that set nothing else; this
    module's tests join it and submit a job to it (one head for both: suite time)."""
    temp_dir = tempfile.mkdtemp(prefix="ray-jobtest-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port, dashboard_port = _free_port(), _free_port()
    bin_dir = Path(sys.executable).parent
    command = [
        str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        # explicit free ports: the defaults could collide with another Ray on this machine
        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
        f"--temp-dir={temp_dir}", "--num-cpus=1", "--disable-usage-stats",
    ]
    env = _clean_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # every listener on 127.0.0.1 (STACK.md)
                     RAY_TMPDIR=temp_dir,
                     PATH=str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))  # jobs find this venv's conclave
    with running_head(command, env, Path(temp_dir) / "head.log", Path(temp_dir)):
        yield Head(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}")


def _submit(client, entrypoint: str, working_dir: Path) -> str:
    """Submit, retrying while the head's job agent is still starting."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(working_dir)})
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(1)


def _wait(client, job_id: str):
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal() or time.monotonic() > deadline:
            return status
        time.sleep(1)


# The smallest real pipeline: sparse DP fine-tuning on the bundled digits (one actor).
TINY_RUN = """\
pipeline: sparse_finetune
name: job-tiny
seed: 0
pretrain: {epochs: 1, batch_size: 64, lr: 0.003}
finetune: {variants: [classifier], epochs: 1, batch_size: 128, target_epsilon: 1.0}
privacy: {budget: 2.0, delta: 1.0e-5}
"""


def test_conclave_run_submitted_as_a_job_to_a_local_head_leaves_its_results(head, tmp_path, monkeypatch):
    from ray._raylet import Config
    from ray.job_submission import JobStatus

    # Token auth, as on a real cluster: the head and this client share ~/.ray/auth_token.
    # Ray caches the mode per process, so refresh it after setting the variable (ray.init
    # in the session fixture does the same when it turns token auth on by default).
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    Config.initialize("")
    working_dir = tmp_path / "job"
    working_dir.mkdir()
    (working_dir / "tiny.yaml").write_text(TINY_RUN)
    results = tmp_path / "results"
    client = head.client()
    job_id = _submit(client, f"conclave run tiny.yaml --results-dir {results}", working_dir)
    status = _wait(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "sparse_finetune run 'job-tiny' finished" in logs
    run = results / "job-tiny"
    config = json.loads((run / "config.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    privacy = json.loads((run / "privacy.json").read_text())
    assert config["pipeline"] == "sparse_finetune" and config["finetune"]["variants"] == ["classifier"]
    assert 0.0 < metrics["variants"]["classifier"]["accuracy"] <= 1.0
    # one DP fine-tuning at ε target 1.0, composed by the job's own ledger, under a budget of 2
    assert 0.5 < privacy["guarantee"]["epsilon"] <= 1.0 + 1e-6 and privacy["spent"]["charges"] == 1
    assert privacy["budget"]["epsilon"] == 2.0 and privacy["sound"]


JOINING_DRIVER = """
import sys, ray
from conclave.cluster.ray_runtime import start_ray, stop_ray
assert start_ray(sys.argv[1]) is False  # joined, not embedded
print(ray.get(ray.put(41)) + 1, ray.nodes()[0]["NodeManagerAddress"])
stop_ray()
"""


def test_the_docs_head_is_joined_from_a_shell_that_set_nothing(head, tmp_path):
    result = subprocess.run([sys.executable, "-c", JOINING_DRIVER, head.address], cwd=PROJECT_ROOT,
                            env=_clean_env(RAY_TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["42", "127.0.0.1"]


def test_cluster_launcher_config_is_valid_for_ray_up():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((PROJECT_ROOT / "ray-cluster.yaml").read_text())
    config = prepare_config(raw)  # what `ray up` does before validating
    validate_config(config)
    node_types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    assert {"head", "cpu_worker", "gpu_worker"} <= set(node_types)
    assert node_types["gpu_worker"]["node_config"]["InstanceType"].startswith(("g", "p"))
    # the working copy, and one token for every node (Ray 2.60 token auth)
    assert config["file_mounts"] == {"~/conclave": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    # every node installs the mounted working copy; CPU nodes pin the CPU build of torch
    head_install = " ".join(config["head_setup_commands"])
    assert "-e ~/conclave" in head_install and "whl/cpu" in head_install
    assert "whl/cpu" in " ".join(node_types["cpu_worker"]["worker_setup_commands"])
    assert "whl/cu" in " ".join(node_types["gpu_worker"]["worker_setup_commands"])
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--include-dashboard=true" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert any("$RAY_HEAD_IP" in command for command in config["worker_start_ray_commands"])
    assert all("RAY_AUTH_MODE=token ray start" in " ".join(commands)
               for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]))
