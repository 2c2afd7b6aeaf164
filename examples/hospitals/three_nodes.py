"""The hospitals example on a head and three owner nodes, all on this machine (127.0.0.1).

    python examples/hospitals/three_nodes.py [CONFIG] [RESULTS_DIR] [--also CONFIG] [--no-tls]   # from the repository root

Starts a head with no CPU for actors (the driver and its aggregator only) and one node per
owner of CONFIG (default configs/hospitals.yaml; configs/hospitals-active.yaml runs the
DP-SGD pipeline the same way), each
with 1 CPU, the owner's custom resource and an ``owner`` node label — what ``ray start
--resources ... --labels ...`` gives each owner's machine in a real deployment
(``ray.cluster_utils.Cluster``: Ray 2.60 refuses ``ray start`` worker nodes on loopback).
Runs the pipeline against that cluster with the owners pinned by resource and label (each
owner's lifetime ledger in an actor on its own node, listed by ``conclave budget``), then
asks for an owner resource no node has; each ``--also`` config then runs on the same cluster
(one start for several pipelines). Prints one JSON line per config: each owner's node id, where its
actors (teachers or DP-SGD shards) ran, which files this driver process opened (a Python audit hook sees every
``open``: none of an owner's), the summary and the run's wall time, and the placement error
with its delay.

Ray's links run over TLS (``--no-tls``: plaintext, to measure what it costs): one CA and one
certificate for 127.0.0.1 made by ``cluster.tls`` in a temporary directory, set in Ray's
variables before the first node starts, so every node, worker and this driver inherit them.
Before stopping, it probes every TCP port this process and the Ray processes it started listen
on: whether an HTTP/2 (gRPC) server answers in plaintext, over TLS without a client certificate,
and over TLS with the node's certificate, and prints that too.
``tests/cluster/test_owners.py`` runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray._private.node import Node

    from conclave.cluster.api import Pipeline
    from conclave.cluster.tls import NodeCertificate

ROOT = Path(__file__).resolve().parents[2]

opened: list[str] = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)

LOOPBACK = "127.0.0.1"
# A client's HTTP/2 preface and an empty SETTINGS frame: a gRPC server answers with its own SETTINGS.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def main(config_paths: list[str], results_dir: str, tls: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="conclave-ray-tls-") as certificates:
        node = None
        if tls:  # before Ray is imported: Ray's C++ side reads its settings once
            from conclave.cluster.tls import LOOPBACK_NAMES, create_authority, issue

            node = issue(create_authority(Path(certificates)), Path(certificates), LOOPBACK_NAMES)
            os.environ.update(node.ray_env())
        run(config_paths, results_dir, node)


def run(config_paths: list[str], results_dir: str, node_certificate: NodeCertificate | None) -> None:
    from ray.cluster_utils import Cluster

    from conclave.cluster.ray_runtime import keep_ray_on_loopback

    keep_ray_on_loopback()
    # The cluster below starts without token auth: say so, or a driver joining it by address turns
    # token auth on whenever a token file exists on the machine (a head ever started with one).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    pipelines = [_pinned_by_label(path) for path in config_paths]
    owners = pipelines[0].config.owners
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # small nodes: the student fits beside a teacher
    try:
        nodes = {o.name: cluster.add_node(num_cpus=1, resources=dict(o.resources), labels={"owner": o.name})
                 for o in owners}
        cluster.wait_for_nodes()
        results = [_run_on(pipeline, cluster.address, nodes, results_dir) for pipeline in pipelines]
        listeners = _listeners()
        probed = {port: {"process": process, "address": address, **_probe(port, node_certificate)}
                  for port, (process, address) in sorted(listeners.items())}
        for result in results:
            print(json.dumps({
                **result,
                "ray_tls": node_certificate is not None,
                "gcs_port": int(cluster.address.rsplit(":", 1)[1]),
                "raylet_ports": sorted(n.node_manager_port for n in [cluster.head_node, *nodes.values()]),
                "listeners": probed,
            }))
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def _pinned_by_label(config_path: str) -> Pipeline:
    """The pipeline of ``config_path`` with each owner pinned by an ``owner`` node label too."""
    from conclave.cluster.api import load_pipeline
    from conclave.cluster.config import load_yaml

    pipeline = load_pipeline(load_yaml(config_path))
    owners = tuple(dataclasses.replace(o, labels={"owner": o.name}) for o in pipeline.config.owners)
    return pipeline.with_config(dataclasses.replace(pipeline.config, owners=owners)).validate()


def _run_on(pipeline: Pipeline, address: str, nodes: dict[str, Node], results_dir: str) -> dict:
    """One run of ``pipeline`` on the cluster at ``address``, then one with an owner no node can
    host: what the JSON line says of them."""
    from conclave.actors.placement import PlacementError
    from conclave.cluster.api import RunContext, RunDirectory

    config = pipeline.config
    owners = config.owners
    start = len(opened)
    context = RunContext("multinode", RunDirectory(results_dir, f"{config.name}-multinode"), address)
    started = time.perf_counter()
    outcome = pipeline.run(context)
    run_seconds = time.perf_counter() - started
    summary, metrics = outcome.summary, outcome.metrics
    ledgers = {name: {"node": account.node, "path": account.ledger} for name, account in outcome.privacy.owners.items()}
    stranger = dataclasses.replace(owners[0], name="hospital_d", resources={"hospital_d": 1}, labels={}, budget=None)
    started = time.perf_counter()
    try:
        pipeline.with_config(dataclasses.replace(config, owners=owners + (stranger,))).run(
            RunContext("stranger", RunDirectory(results_dir, f"{config.name}-stranger"), address))
        placement_error = None
    except PlacementError as err:
        placement_error = str(err)
    placement_error_seconds = time.perf_counter() - started
    owner_dirs = {str(Path(o.data.path).resolve().parent) for o in owners}
    during = opened[start:]
    return {
        "config": config.name,
        "owner_nodes": {name: node.node_id for name, node in nodes.items()},
        "actor_nodes": metrics["teachers" if "teachers" in metrics else "shards"]["nodes"],
        "owner_ledgers": ledgers,  # each owner's lifetime ledger, in an actor on its own node
        "budget_listing": _budget_listing(sorted({str(Path(v["path"]).parent) for v in ledgers.values()})),
        "driver_opened_owner_files": sorted({p for p in opened if str(Path(p).resolve().parent) in owner_dirs}),
        "driver_opened_public_files": sorted({p for p in during if p.endswith((".csv", ".parquet"))}),
        "summary": summary,
        "run_seconds": run_seconds,
        "placement_error": placement_error,
        "placement_error_seconds": placement_error_seconds,
    }


def _budget_listing(folders: list[str]) -> list[dict]:
    """What ``conclave budget --json FOLDER...`` says of the owners' ledgers (name, spend, charges)."""
    import contextlib
    import io

    from conclave.cluster import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["budget", "--json", *folders])
    return [{"name": v["name"], "epsilon_spent": v["spent"]["epsilon"], "charges": v["spent"]["charges"],
             "budget": v["budget"]["epsilon"]} for v in json.loads(out.getvalue())]


def _listeners() -> dict[int, tuple[str, str]]:
    """Each TCP port this process and the Ray processes it started listen on: (process name, address)."""
    import psutil

    me = psutil.Process()
    ports: dict[int, tuple[str, str]] = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            for connection in process.net_connections(kind="tcp"):
                if connection.status == psutil.CONN_LISTEN:
                    ports[connection.laddr.port] = (process.name(), connection.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # a worker that exited meanwhile
    return ports


def _probe(port: int, node_certificate: NodeCertificate | None) -> dict[str, bool]:
    """Whether a gRPC server on 127.0.0.1:``port`` answers in plaintext, over TLS without a
    client certificate, and over TLS with the node's certificate (when there is one). Ray's
    servers log each handshake they refuse ("Handshake failed"): those lines are these probes."""
    answers = {"plaintext_grpc": _answers_http2(port, None)}
    if node_certificate is not None:
        anonymous = ssl.create_default_context(cafile=str(node_certificate.ca))
        anonymous.set_alpn_protocols(["h2"])
        member = ssl.create_default_context(cafile=str(node_certificate.ca))
        member.set_alpn_protocols(["h2"])
        member.load_cert_chain(node_certificate.certificate, node_certificate.key)
        answers["tls_without_certificate"] = _answers_http2(port, anonymous)
        answers["tls_with_node_certificate"] = _answers_http2(port, member)
    return answers


def _answers_http2(port: int, context: ssl.SSLContext | None) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=10) as raw, \
                (context.wrap_socket(raw, server_hostname=LOOPBACK) if context else raw) as connection:
            connection.sendall(HTTP2_PREFACE)
            frame = b""
            while len(frame) < 9:  # a frame header: length (3 bytes), type, flags, stream (4)
                chunk = connection.recv(9 - len(frame))
                if not chunk:
                    return False
                frame += chunk
            return frame[3] == 0x04  # SETTINGS
    except OSError:  # refused, reset, timed out, or a failed handshake (ssl.SSLError)
        return False


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    parser = argparse.ArgumentParser(description="The hospitals example on a head and three owner nodes on 127.0.0.1.")
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "hospitals.yaml"))
    parser.add_argument("results_dir", nargs="?", default=str(ROOT / "results"))
    parser.add_argument("--also", action="append", default=[], metavar="CONFIG",
                        help="another owners config to run on the same cluster, after the first (repeatable)")
    parser.add_argument("--no-tls", dest="tls", action="store_false", help="Ray's links in plaintext")
    arguments = parser.parse_args()
    main([arguments.config, *arguments.also], arguments.results_dir, arguments.tls)
