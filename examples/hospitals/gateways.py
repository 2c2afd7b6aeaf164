"""The hospitals example with each hospital behind its own gateway, all on this machine (127.0.0.1).

    python examples/hospitals/gateways.py [RESULTS_DIR] [CONFIG ...]   # from the repository root

What a deployment does on four machines, here in one temporary folder with one folder per
machine: the consortium's CA and a certificate for each hospital (common name: the hospital) and
for the coordinator (``conclave ray-certs``); on each hospital's machine its records, its policy
(``conclave owner init``, in its own ``CONCLAVE_HOME``), its own file and ``conclave owner serve``
with its own Ray (1 CPU) on an ephemeral port; then on the coordinator's machine ``conclave run``
on a config that names the three gateways and no owner's path: CONFIG (default
configs/hospitals-clusters.yaml, public-cluster votes; configs/hospitals-knn.yaml: kNN votes;
configs/hospitals.yaml: teachers, trained at each gateway; configs/hospitals-active.yaml: DP-SGD
active learning, each step a secure sum of the gateways' shares, then NearPrivate's two) with its
owners replaced by their gateways, in secure rounds. Several CONFIGs run one after another
through the same gateways, each owner's ledger composing them. For each run it prints the
student's (or the DP-SGD checkpoint's) accuracy and ε and one JSON line: the results folder, the
summary, the guarantee, each owner's ledger for that run (charges and ε spent), the coordinator's
config, which of the owners' files the coordinator's process opened (a Python audit hook: none),
and the wall time of the gateways' start and of the coordinator's run; then it stops the gateways
by their PIDs.
``tests/cluster/test_gateway_run.py`` runs it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "hospitals" / "data"
HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
LOOPBACK = "127.0.0.1"
# The coordinator's process, with every file it opens written down as it exits (``opened.json``).
AUDITED_RUN = """import atexit, json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)
atexit.register(lambda: open("opened.json", "w").write(json.dumps(sorted(set(opened)))))
from conclave.cluster.cli import main
sys.exit(main(sys.argv[1:]))
"""


def conclave(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """``conclave ARGS`` (this interpreter's), its output; a failure is its own one line."""
    done = subprocess.run([sys.executable, "-m", "conclave.cluster.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"conclave {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def owner_machine(folder: Path, owner: str, ca: Path) -> dict[str, str]:
    """One hospital's machine: its records, certificate, policy and own file; its environment."""
    folder.mkdir()
    env = {**os.environ, "CONCLAVE_HOME": str(folder / "home")}
    env.pop("RAY_ADDRESS", None)
    shutil.copyfile(DATA / owner / "records.csv", folder / "records.csv")
    conclave("ray-certs", str(folder / "certs"), "--ca", str(ca), "--hosts", LOOPBACK, "--owner", owner)
    conclave("owner", "init", owner, "--epsilon", "20", "--max-run-epsilon", "6", "--mechanisms", "public-clusters",
             "private-knn", "gnmax", "dpsgd", "dp-pca", "noisy-counts", "--ledger", str(folder / "ledger"), "--data", str(folder / "records.csv"), env=env)
    declaration = {"name": owner, "data": {"format": "csv", "path": "records.csv", "label": "diagnosis"},
                   "records": 100, "listen": f"{LOOPBACK}:0",
                   "tls": {"certificate": "certs/node.pem", "key": "certs/node.key", "ca": "certs/ca.pem"},
                   "peers": [other for other in HOSPITALS if other != owner],
                   "ray": {"address": "local", "num_cpus": 1}, "vote_sources": ["clusters", "knn", "teachers"]}
    (folder / f"{owner}.yaml").write_text(yaml.safe_dump(declaration, sort_keys=False))
    return env


def serve(folder: Path, owner: str, env: dict[str, str]) -> subprocess.Popen:
    """``conclave owner serve`` on the hospital's machine (its own Ray starts: a few seconds)."""
    return subprocess.Popen([sys.executable, "-m", "conclave.cluster.cli", "owner", "serve", f"{owner}.yaml"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def address_of(gateway: subprocess.Popen, owner: str) -> str:
    """The address a started gateway prints once serving; its further log is drained meanwhile."""
    said = ""
    for line in gateway.stdout:  # "owner hospital_a: gateway serving on 127.0.0.1:PORT (...)"
        if "gateway serving on" in line:
            threading.Thread(target=gateway.stdout.read, daemon=True).start()
            return line.split("gateway serving on ")[1].split()[0]
        said = line.strip() or said
    raise SystemExit(f"owner {owner}'s gateway did not start (exit {gateway.wait()}): {said}")


def coordinator_config(source: Path, certs: Path, addresses: dict[str, str]) -> dict:
    """The config at ``source``, its owners named by their gateways alone."""
    config = yaml.safe_load(source.read_text())
    teachers = {o["name"]: o["teachers"] for o in config["owners"] if "teachers" in o}  # each trains at its gateway
    owners = [{"name": o, "gateway": a, **({"teachers": teachers[o]} if o in teachers else {})}
              for o, a in addresses.items()]
    config.update(name=f"{config['name']}-gateways", owners=owners,
                  gateways={"certificate": str(certs / "node.pem"), "key": str(certs / "node.key"),
                            "ca": str(certs / "ca.pem")},
                  test={**config["test"], "path": str(DATA / "public" / "test.csv")})
    if config["pipeline"] == "active_learning":  # DP-SGD steps at the gateways; the oracle reads the pool's labels
        config["public"]["path"] = str(DATA / "public" / Path(config["public"]["path"]).name)
    else:
        config.update(aggregation="secure", public={**config["public"], "path": str(DATA / "public" / "unlabeled.csv")})
    return config


def stop(gateways: dict[str, subprocess.Popen]) -> None:
    """SIGTERM each gateway this script started, by its PID; it stops its Ray and exits."""
    for gateway in gateways.values():
        if gateway.poll() is None:
            os.kill(gateway.pid, signal.SIGTERM)
    for gateway in gateways.values():
        try:
            gateway.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(gateway.pid, signal.SIGKILL)
            gateway.wait()


def main(results_dir: Path, *sources: Path) -> list[dict]:
    """Each config of ``sources`` (default: hospitals-clusters) run in turn through the same three
    gateways, as a consortium runs one study after another; one outcome per run."""
    sources = sources or (ROOT / "configs" / "hospitals-clusters.yaml",)
    with tempfile.TemporaryDirectory(prefix="conclave-gateways-") as scratch:
        scratch = Path(scratch)
        conclave("ray-certs", str(scratch / "consortium-ca"))  # the consortium's CA (its key stays here)
        ca = scratch / "consortium-ca"
        machines = {owner: scratch / owner for owner in HOSPITALS}
        envs = {owner: owner_machine(folder, owner, ca) for owner, folder in machines.items()}
        coordinator = scratch / "coordinator"
        coordinator.mkdir()
        conclave("ray-certs", str(coordinator / "certs"), "--ca", str(ca), "--hosts", LOOPBACK)
        gateways: dict[str, subprocess.Popen] = {}
        outcomes = []
        try:
            started = time.monotonic()
            for owner, folder in machines.items():  # all three start at once, each its own Ray
                gateways[owner] = serve(folder, owner, envs[owner])
            addresses = {owner: address_of(gateway, owner) for owner, gateway in gateways.items()}
            serving = time.monotonic() - started
            for source in sources:
                before = ledgers_of(machines)
                config = coordinator_config(source, coordinator / "certs", addresses)
                (coordinator / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
                env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "CONCLAVE_HOME")}
                env["CONCLAVE_HOME"] = str(coordinator / "home")
                began = time.monotonic()
                run = subprocess.run([sys.executable, "-c", AUDITED_RUN, "run", "run.yaml",
                                      "--results-dir", str(results_dir.resolve())],
                                     cwd=coordinator, env=env, capture_output=True, text=True)
                if run.returncode:
                    raise SystemExit(f"conclave run of {source.name} failed ({run.returncode}): "
                                     f"{run.stderr.strip()[-2000:]}")
                print(run.stdout.strip())
                seconds = {"gateways_serving": serving, "coordinator_run": time.monotonic() - began}
                outcomes.append({**report(results_dir / config["name"], config, machines, coordinator, before),
                                 "seconds": seconds})
        finally:
            stop(gateways)
        return outcomes


def ledgers_of(machines: dict[str, Path]) -> dict:
    """Each hospital's ledger as it stands (None before its first charge)."""
    from conclave.privacy.accounting.ledger import read_ledger

    files = {owner: folder / "ledger" / f"{owner}.sqlite" for owner, folder in machines.items()}
    return {owner: read_ledger(path) if path.exists() else None for owner, path in files.items()}


def report(results: Path, config: dict, machines: dict[str, Path], coordinator: Path, before: dict) -> dict:
    """One run's outcome: each owner's ledger charges and ε of this run alone (after − before)."""
    from conclave.privacy.accounting.rdp import epsilon_from_rdp

    privacy = json.loads((results / "privacy.json").read_text())
    metrics = json.loads((results / "metrics.json").read_text())
    ledgers = {}
    for owner, after in ledgers_of(machines).items():
        earlier = before[owner]
        rdp = after.spent.rdp - (earlier.spent.rdp if earlier else 0)
        labels = [label for label, charge in after.by_label.items()
                  if earlier is None or label not in earlier.by_label
                  or (charge.rdp != earlier.by_label[label].rdp).any()]
        ledgers[owner] = {"charges": after.charges - (earlier.charges if earlier else 0), "labels": sorted(labels),
                          "epsilon_spent": epsilon_from_rdp(after.orders, rdp, after.delta)[0]}
    owned = [str(folder) for folder in machines.values()]
    opened = json.loads((coordinator / "opened.json").read_text())
    accuracy = {"student_accuracy": metrics["student_accuracy"]} if "student_accuracy" in metrics else {
        "dp_checkpoint_accuracy": metrics["checkpoints"][-1]["test_accuracy"]}  # active learning
    return {"results": str(results), **accuracy,
            "guarantee": privacy["guarantee"], "owners": ledgers, "config": config,
            "opened_owner_files": [path for path in opened if any(path.startswith(o) for o in owned)]}


if __name__ == "__main__":
    for outcome in main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results"),
                        *(Path(path).resolve() for path in sys.argv[2:])):
        guarantee = outcome["guarantee"]
        said = "student" if "student_accuracy" in outcome else "DP-SGD checkpoint"
        accuracy = outcome.get("student_accuracy", outcome.get("dp_checkpoint_accuracy"))
        print(f"{said} accuracy {accuracy:.3f}; guarantee ε {guarantee['epsilon']:.4g} at "
              f"δ {guarantee['delta']:g}; each owner's ledger for this run: " + ", ".join(
                  f"{owner} ε {ledger['epsilon_spent']:.4g} over {ledger['charges']} charge(s)"
                  for owner, ledger in outcome["owners"].items()))
        print(json.dumps(outcome))
