"""The hospitals example on a head and three owner nodes, all on this machine (127.0.0.1).

    python examples/hospitals/three_nodes.py [CONFIG] [RESULTS_DIR]   # from the repository root

Starts a head with no CPU for actors (the driver and its aggregator only) and one node per
owner of CONFIG (default configs/hospitals.yaml; configs/hospitals-active.yaml runs the
DP-SGD pipeline the same way), each
with 1 CPU, the owner's custom resource and an ``owner`` node label — what ``ray start
--resources ... --labels ...`` gives each owner's machine in a real deployment
(``ray.cluster_utils.Cluster``: Ray 2.60 refuses ``ray start`` worker nodes on loopback).
Runs the pipeline against that cluster with the owners pinned by resource and label, then
asks for an owner resource no node has. Prints one JSON line: each owner's node id, where its
actors (teachers or DP-SGD shards) ran, which files this driver process opened (a Python audit hook sees every
``open``: none of an owner's), the summary, and the placement error with its delay.
``tests/cluster/test_owners.py`` runs it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

opened: list[str] = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)


def main(config_path: str, results_dir: str) -> None:
    from ray.cluster_utils import Cluster

    from actors.placement import PlacementError
    from cluster.config import load_yaml
    from cluster.pipelines import RunContext, pipeline_module
    from cluster.ray_runtime import keep_ray_on_loopback
    from cluster.results import RunDirectory
    from cluster.run_command import load_run_config

    keep_ray_on_loopback()
    name, config = load_run_config(load_yaml(config_path))
    pipeline = pipeline_module(name)
    owners = tuple(dataclasses.replace(o, labels={"owner": o.name}) for o in config.owners)
    config = pipeline.validate(dataclasses.replace(config, owners=owners))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # small nodes: the student fits beside a teacher
    try:
        nodes = {o.name: cluster.add_node(num_cpus=1, resources=dict(o.resources), labels={"owner": o.name})
                 for o in owners}
        cluster.wait_for_nodes()
        context = RunContext("multinode", RunDirectory(results_dir, "multinode"), cluster.address)
        outcome = pipeline.run(config, context)
        summary, metrics = outcome.summary, outcome.metrics
        stranger = dataclasses.replace(owners[0], name="hospital_d", resources={"hospital_d": 1}, labels={})
        started = time.perf_counter()
        try:
            pipeline.run(dataclasses.replace(config, owners=owners + (stranger,)),
                         RunContext("stranger", RunDirectory(results_dir, "stranger"), cluster.address))
            placement_error = None
        except PlacementError as err:
            placement_error = str(err)
        owner_dirs = {str(Path(o.data.path).resolve().parent) for o in owners}
        print(json.dumps({
            "owner_nodes": {name: node.node_id for name, node in nodes.items()},
            "actor_nodes": metrics["teachers" if "teachers" in metrics else "shards"]["nodes"],
            "driver_opened_owner_files": sorted({p for p in opened
                                                 if str(Path(p).resolve().parent) in owner_dirs}),
            "driver_opened_public_files": sorted({p for p in opened if p.endswith((".csv", ".parquet"))}),
            "summary": summary,
            "placement_error": placement_error,
            "placement_error_seconds": time.perf_counter() - started,
        }))
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    arguments = sys.argv[1:] + [str(ROOT / "configs" / "hospitals.yaml"), str(ROOT / "results")][len(sys.argv) - 1:]
    main(*arguments[:2])
