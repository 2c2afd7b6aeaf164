"""``conclave owner serve`` as an owner runs it: the real CLI in its own process, with its own Ray,
answering Describe over mutual TLS; refused without a policy; closed to a client the consortium's
CA did not certify; stopped cleanly by SIGTERM."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from conclave.cluster.gateway.client import CoordinatorTls, OwnerGateway
from conclave.cluster.tls import create_authority, issue
from conclave.learning.data import load_digits
from tests.gateways import channel_to


def _conclave(*args: str, env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conclave", *args], env=env, capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.fixture
def owner_machine(tmp_path):
    """An owner's folder: certificates, its records, its declaration (relative paths), an environment."""
    authority = create_authority(tmp_path / "ca", "consortium test CA", days=1)
    issue(authority, tmp_path / "owner", ("127.0.0.1",), name="gateway", days=1, common_name="hospital_a")
    coordinator = issue(authority, tmp_path / "coordinator", (), name="coordinator", days=1)
    stranger_ca = create_authority(tmp_path / "stranger-ca", "another CA", days=1)
    stranger = issue(stranger_ca, tmp_path / "stranger", (), name="stranger", days=1)
    train, _ = load_digits()
    np.savez(tmp_path / "owner" / "records.npz", x=train.x[:200], y=train.y[:200].astype(str))
    declaration = tmp_path / "owner" / "owner.yaml"
    declaration.write_text(yaml.safe_dump({
        "name": "hospital_a", "data": {"format": "npz", "path": "records.npz", "label": "y"}, "records": 200,
        "listen": "127.0.0.1:0", "tls": {"certificate": "gateway.pem", "key": "gateway.key", "ca": "ca.pem"},
        "peers": ["hospital_b", "hospital_c"], "ray": {"num_cpus": 1}}))
    env = {**os.environ, "CONCLAVE_HOME": str(tmp_path / "home"), "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray-", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    tls = CoordinatorTls(coordinator.certificate, coordinator.key, coordinator.ca)
    return declaration, env, tls, CoordinatorTls(stranger.certificate, stranger.key, coordinator.ca)


def test_without_a_policy_the_gateway_does_not_start(owner_machine):
    declaration, env, _, _ = owner_machine
    done = _conclave("owner", "serve", str(declaration), env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == ["conclave: owner hospital_a has no policy on this machine: write one with "
                     "`conclave owner init hospital_a --epsilon E`"], done.stderr


def test_the_cli_gateway_answers_over_mutual_tls_and_stops_on_sigterm(owner_machine):
    declaration, env, tls, stranger = owner_machine
    assert _conclave("owner", "init", "hospital_a", "--epsilon", "5", env=env).returncode == 0
    serving = subprocess.Popen([sys.executable, "-m", "conclave", "owner", "serve", str(declaration)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in serving.stdout], daemon=True).start()
    try:
        deadline, first = time.monotonic() + 180, ""
        while "serving on" not in first:
            try:
                first = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no serving line (rc {serving.poll()})")
        address = first.split("serving on ")[1].split()[0]
        gateway = OwnerGateway(address, tls)
        description = gateway.describe()
        gateway.close()
        assert (description.owner, description.records, description.epsilon) == ("hospital_a", 200, 5.0)
        with channel_to(address, stranger) as channel:  # a certificate the consortium's CA did not issue
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary("/conclave.owner.Owner/Describe")(b"", timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        no_certificate = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca).read_bytes())
        with grpc.secure_channel(address, no_certificate) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary("/conclave.owner.Owner/Describe")(b"", timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=60) == 0, serving.stderr.read()[-3000:]
        assert "owner hospital_a: gateway stopped" in [lines.get(timeout=5).strip() for _ in range(lines.qsize())]
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()
