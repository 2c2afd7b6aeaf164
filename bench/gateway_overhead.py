"""Benchmark: what owners' gateways in processes of their own cost, beside gateways in the run's own process.

Every run reaches its owners through their gateways. On one machine a config naming its owners by
their data starts their gateways in its own process (``cluster.gateway.local``); a consortium's
owners run ``conclave owner serve`` each. The hospitals example's three owners on
configs/hospitals-clusters.yaml's terms (each record votes for its 3 nearest queries, standardised
PCA of the public pool to 5 dimensions, σ 6), asked about the 20 medoids of the public pool (k-means
in that embedding, as the student's ``clusters`` selection picks them), two ways in one run:

- **in-process**: the three owners' gateways started by ``LocalGateways`` in this process, over
  this process's Ray, mutual TLS on 127.0.0.1, as ``conclave run`` starts them for owners named by
  their data;
- **gateways**: three ``conclave owner serve`` processes, each with its own local Ray (1 CPU), its
  own ``$CONCLAVE_HOME`` and policy, mutual TLS on 127.0.0.1.

Both are reached by the same ``GatewayVoteSource.noised_votes``, charged to the coordinator's view,
each gateway charging its owner's ledger before it answers. A release (keys, shares, decode) is timed
as the user waits for it, the two paths interleaved (in-process, gateways, in-process, ...) after a
warm-up each; medians and the ratio of medians. The one-off starts (the gateways' processes and
their Rays, the in-process gateways, ``Admit``) are timed apart. The policies' budgets are large:
the owners' tables are public stand-in data.

Then a DP-SGD epoch of configs/hospitals-active.yaml (logistic regression, batches of 30 of the
declared 300 records: 10 steps an epoch, z 2), the ``active_learning`` pipeline run whole both
ways (``load_pipeline(...).run``, one cheap strategy, NearPrivate left out): the config naming the
owners by their data (its gateways in this process), and naming the same three served gateways
(``GatewayDpsgd``, each step charged at every gateway, either way). A run of 1 and one of 6 epochs
each time, interleaved; an epoch is a fifth of their difference (the one-off starts cancel out as
far as they take the same time in both).
Writes results/bench/gateway_overhead.json (``sound: false``: it times work on the records).

    python bench/gateway_overhead.py                # 15 releases and 3 DP-SGD pairs each (minutes on 2 cores)
    python bench/gateway_overhead.py --repeats 10 --dpsgd-repeats 2
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores  # noqa: E402  (before torch loads)

share_cores()

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from bench.soundness import soundness, timed_on, timed_private_work  # noqa: E402
from conclave.cluster.api import (  # noqa: E402
    Authority, DataOwner, PublicData, RunContext, RunDirectory, create_authority, issue, load_pipeline, load_yaml,
)
from conclave.privacy.accounting.owner_policy import OwnerPolicy, write_policy  # noqa: E402
from conclave.privacy.accounting.ledger import PrivacyLedger  # noqa: E402
from conclave.privacy.noise import SECURE  # noqa: E402
from conclave.privacy.secure_votes import SkellamVotes, cluster_votes  # noqa: E402

log = logging.getLogger("bench.gateway_overhead")

CONFIG = "configs/hospitals-clusters.yaml"
ACTIVE_CONFIG = "configs/hospitals-active.yaml"
EPOCHS = (1, 6)  # an epoch: a fifth of the difference of the two runs' times
STAND_IN_DATA = "the example hospitals' synthetic tables"
POLICY_EPSILON = 1000.0  # stand-in public data: a budget no repetition count reaches
GOAL_RATIO = 1.5  # issue 52: gateways of their own within 1.5x of the one-machine path
SERVE_WAIT_S = 300.0  # three Rays starting at once on a shared machine


def medoid_queries(embedded: np.ndarray, pool: np.ndarray, count: int, seed: int) -> np.ndarray:
    """The pool inputs at the ``count`` medoids of its k-means clusters (the student's ``clusters`` round)."""
    from conclave.learning.selection.clusters import cluster_pool

    return pool[cluster_pool(embedded, count, seed).medoids]


@contextlib.contextmanager
def _home(path: Path) -> Iterator[None]:
    """``$CONCLAVE_HOME`` set to ``path`` inside the block (a policy written on that owner's machine)."""
    before = os.environ.get("CONCLAVE_HOME")
    os.environ["CONCLAVE_HOME"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CONCLAVE_HOME", None)
        else:
            os.environ["CONCLAVE_HOME"] = before


def owner_files(directory: Path, owners: Sequence[DataOwner], authority: Authority) -> dict[str, Path]:
    """Each owner's machine in a folder of its own: its certificate, its policy in its own
    ``$CONCLAVE_HOME`` (a large budget), and its declaration for ``conclave owner serve``."""
    names = [owner.name for owner in owners]
    files = {}
    for owner in owners:
        folder = directory / owner.name
        certificate = issue(authority, folder / "tls", ("127.0.0.1",), name=owner.name, days=1,
                            common_name=owner.name)
        data = str((ROOT / owner.data.path).resolve())
        with _home(folder / "home"):
            write_policy(OwnerPolicy(owner.name, POLICY_EPSILON, str(folder / "ledger"), data=(data,)))
        source = {"format": owner.data.format, "path": data, "label": owner.data.label}
        declaration = {"name": owner.name, "data": source, "records": owner.records, "listen": "127.0.0.1:0",
                       "tls": {"certificate": str(certificate.certificate), "key": str(certificate.key),
                               "ca": str(certificate.ca)},
                       "peers": [n for n in names if n != owner.name], "ray": {"address": "local", "num_cpus": 1},
                       "vote_sources": ["clusters"]}
        files[owner.name] = folder / "owner.yaml"
        files[owner.name].write_text(yaml.safe_dump(declaration))
    return files


class ServedGateway:
    """One ``conclave owner serve`` process, started now; ``serving`` waits for its line and address."""

    def __init__(self, owner: str, declaration: Path) -> None:
        self.owner = owner
        env = {**os.environ, "CONCLAVE_HOME": str(declaration.parent / "home")}
        env.pop("RAY_ADDRESS", None)
        self._log = (declaration.parent / "serve.log").open("w")
        self.process = subprocess.Popen([str(Path(sys.executable).parent / "conclave"), "owner", "serve",
                                         str(declaration)], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env=env, cwd=declaration.parent)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def serving(self, deadline: float) -> str:
        """The address it serves on (waits until ``deadline``)."""
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"owner {self.owner}'s gateway did not serve within {SERVE_WAIT_S:g} s") from None
            if line is None:
                self._log.flush()
                said = (Path(self._log.name).read_text().strip().splitlines() or ["nothing"])[-1]
                raise RuntimeError(f"owner {self.owner}'s gateway exited {self.process.wait()}: {said}")
            if " gateway serving on " in line:
                return line.split(" gateway serving on ")[1].split()[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def active_config(epochs: int, owners: Sequence[DataOwner], addresses: Sequence[str] | None,
                  certificates: dict[str, str]) -> dict:
    """hospitals-active.yaml at ``epochs`` with one cheap strategy, the owners declaring ``owners``'
    records, no budgets (the owners' large policies decide): named by their data (``addresses`` None:
    their gateways in this process) or by the gateways at ``addresses``."""
    raw = load_yaml(ROOT / ACTIVE_CONFIG)
    raw["dpsgd"]["epochs"] = epochs
    raw["selection"].update(strategies=["random"], sizes=[10])
    raw["finetune"]["epochs"] = 1
    raw["privacy"]["budget"] = None
    if addresses is None:
        declared = {owner.name: owner.records for owner in owners}
        for owner in raw["owners"]:
            owner.pop("budget")
            owner["records"] = declared[owner["name"]]
    else:
        raw["owners"] = [{"name": owner.name, "gateway": address} for owner, address in zip(owners, addresses)]
        raw["gateways"] = dict(certificates)
    return raw


def pipeline_seconds(raw: dict, results: Path, run: str) -> float:
    """One whole run of the pipeline ``raw`` names, as ``conclave run`` makes it (validated first, untimed)."""
    pipeline = load_pipeline(raw).validate()
    began = time.perf_counter()
    pipeline.run(RunContext(run, RunDirectory(results, run)))
    return time.perf_counter() - began


def dpsgd_epochs(owners: Sequence[DataOwner], addresses: Sequence[str], certificates: dict[str, str],
                 results: Path, repeats: int) -> dict[str, dict[int, list[float]]]:
    """Each path's whole-run seconds at each of ``EPOCHS``, interleaved, after one untimed run each."""
    paths = {"in_process": None, "gateways": addresses}
    seconds: dict[str, dict[int, list[float]]] = {name: {epochs: [] for epochs in EPOCHS} for name in paths}
    for repetition in range(-1, repeats):
        for epochs in EPOCHS if repetition >= 0 else EPOCHS[:1]:
            for name, reached in paths.items():
                took = pipeline_seconds(active_config(epochs, owners, reached, certificates), results,
                                        f"dpsgd-{name}-{epochs}-{repetition + 1}")
                log.info("DP-SGD %s, %d epoch(s): %.2f s", name, epochs, took)
                if repetition >= 0:
                    seconds[name][epochs].append(took)
    return seconds


def _median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed releases of each path (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed releases of each path first (default 2)")
    parser.add_argument("--dpsgd-repeats", type=int, default=3,
                        help=f"timed pipeline runs of each path at each of {EPOCHS} epochs (default 3)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    if args.repeats < 10:
        parser.error("--repeats: at least 10 releases of each path")
    if args.dpsgd_repeats < 1:
        parser.error("--dpsgd-repeats: at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.chdir(ROOT)  # the config's data paths are the repository's
    started_at, load_before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()[0]

    from conclave.cluster.api import (
        ClusterVotes, CoordinatorTls, GatewayVoteSource, LocalGateways, OwnerGateway, Verifier, start_ray, stop_ray,
    )
    from conclave.learning.embeddings import fit_embedding

    config = load_pipeline(load_yaml(ROOT / CONFIG)).config
    terms, sigma = config.clusters, float(config.mechanism.params["sigma"])
    public = PublicData.read(config.public, config.test, config.classes)
    pool = np.asarray(public.splits.public.x, dtype=np.float32)
    embed = fit_embedding(terms.embedding, pool, terms.dims)
    queries = medoid_queries(np.asarray(embed(pool)).reshape(len(pool), -1), pool, terms.count,
                             config.student.selection.seed)
    release = SkellamVotes(sigma, cluster_votes(terms.votes_per_record))
    rounds = args.warmup + args.repeats

    with tempfile.TemporaryDirectory(prefix="conclave-bench-gateways-") as temporary:
        directory = Path(temporary)
        os.environ["CONCLAVE_HOME"] = str(directory / "coordinator-home")  # the in-process gateways' owners
        authority = create_authority(directory / "ca", "gateway bench CA", days=1)
        coordinator = issue(authority, directory / "coordinator", (), name="coordinator", days=1)
        tls = CoordinatorTls(coordinator.certificate, coordinator.key, coordinator.ca)
        for owner in config.owners:  # the same large budget for the in-process gateways' owners
            write_policy(OwnerPolicy(owner.name, POLICY_EPSILON, str(directory / "in-process-ledgers" / owner.name),
                                     data=(str((ROOT / owner.data.path).resolve()),)))
        declarations = owner_files(directory, config.owners, authority)

        started = time.perf_counter()
        served = [ServedGateway(owner, path) for owner, path in declarations.items()]
        local = in_process = gateways = None
        try:
            deadline = time.monotonic() + SERVE_WAIT_S
            addresses = [gateway.serving(deadline) for gateway in served]
            serve_s = time.perf_counter() - started
            log.info("%d gateways serving in %.1f s: %s", len(served), serve_s, addresses)

            start_ray()
            votes = ClusterVotes(terms.votes_per_record, terms.embedding, terms.dims)
            began = time.perf_counter()
            local = LocalGateways.start(config.owners)
            local_tls = CoordinatorTls(Path(local.gateways.certificate), Path(local.gateways.key),
                                       Path(local.gateways.ca))
            in_process = GatewayVoteSource([OwnerGateway(local.addresses[owner.name], local_tls)
                                            for owner in config.owners], Verifier(local_tls.ca),
                                           "gateway-bench-in-process", votes, config.mechanism.name, sigma,
                                           public.classes, pool, max_batch=len(queries), rounds=rounds)
            in_process_start_s = time.perf_counter() - began
            began = time.perf_counter()
            gateways = GatewayVoteSource([OwnerGateway(address, tls) for address in addresses], Verifier(tls.ca),
                                         "gateway-bench", votes, config.mechanism.name, sigma, public.classes, pool,
                                         max_batch=len(queries), rounds=rounds)
            admit_s = time.perf_counter() - began
            log.info("in-process gateways started and admitted the run in %.2f s; the served gateways admitted it "
                     "in %.2f s", in_process_start_s, admit_s)

            in_process_view = PrivacyLedger(directory / "in-process-view.sqlite", config.privacy.delta, None)
            view = PrivacyLedger(directory / "coordinator-view.sqlite", config.privacy.delta, None)
            one = release.charge(len(queries), config.mechanism.name)
            paths = {"in_process": (in_process, lambda: in_process_view.charge(one)),
                     "gateways": (gateways, lambda: view.charge(one))}
            seconds: dict[str, list[float]] = {name: [] for name in paths}
            for repetition in range(rounds):
                for name, (source, charge) in paths.items():
                    began = time.perf_counter()
                    totals = source.noised_votes(queries, release, SECURE, charge)
                    took = time.perf_counter() - began
                    assert totals.shape == (len(queries), len(public.classes)), totals.shape
                    if repetition >= args.warmup:
                        seconds[name].append(took)
            owners_charged = {gateway.owner: OwnerGateway(address, tls).budget().charges
                              for gateway, address in zip(served, addresses)}
            in_process_view.close()
            view.close()
            in_process.shutdown()
            in_process = None
            local.stop()
            local = None
            certificates = {"certificate": str(tls.certificate), "key": str(tls.key), "ca": str(tls.ca)}
            dpsgd = dpsgd_epochs(config.owners, addresses, certificates, directory / "runs", args.dpsgd_repeats)
        finally:
            for source in (in_process, gateways):
                if source is not None:
                    source.shutdown()
            if local is not None:
                local.stop()
            stop_ray()
            for gateway in served:
                gateway.stop()

    low, high = EPOCHS
    epoch = {name: [(b - a) / (high - low) for a, b in zip(runs[low], runs[high])] for name, runs in dpsgd.items()}
    epoch_ratio = statistics.median(epoch["gateways"]) / statistics.median(epoch["in_process"])
    medians = {name: _median_ms(values) for name, values in seconds.items()}
    pairs = [b / a for a, b in zip(seconds["in_process"], seconds["gateways"])]
    ratio = statistics.median(seconds["gateways"]) / statistics.median(seconds["in_process"])
    result = {
        "benchmark": "gateway_overhead",
        "build": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip(),
        "started": started_at,
        "setup": {"config": CONFIG, "owners": [owner.name for owner in config.owners],
                  "declared_records": [owner.records for owner in config.owners],
                  "queries": f"the {len(queries)} medoids of the public pool's k-means clusters in the "
                             f"{terms.embedding} embedding ({terms.dims} dims), seed {config.student.selection.seed}",
                  "votes_per_record": terms.votes_per_record, "sigma": sigma, "cpus": os.cpu_count(),
                  "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
                  "in_process": "the three owners' gateways in this process (LocalGateways), over its Ray, mutual "
                                "TLS on 127.0.0.1; GatewayVoteSource.noised_votes",
                  "gateways": "three `conclave owner serve` processes, each its own local Ray (1 CPU) and "
                              "CONCLAVE_HOME, mutual TLS on 127.0.0.1; GatewayVoteSource.noised_votes",
                  "charged": "the coordinator's view and, at each gateway, its owner's ledger (both ways)",
                  "warmup": args.warmup, "repeats": args.repeats, "order": "interleaved: in-process, gateways, ..."},
        "release_seconds": {name: [round(s, 5) for s in values] for name, values in seconds.items()},
        "release_median_ms": medians,
        "ratio_of_medians": round(ratio, 3),
        "paired_ratio": {"min": round(min(pairs), 3), "median": round(statistics.median(pairs), 3)},
        "start_seconds": {"gateway_processes_serving": round(serve_s, 2), "admit": round(admit_s, 3),
                          "in_process_gateways_and_admit": round(in_process_start_s, 3)},
        "owners_charged_at_gateways": owners_charged,
        "dpsgd_epoch": {
            "config": ACTIVE_CONFIG, "epochs_per_run": list(EPOCHS), "repeats": args.dpsgd_repeats,
            "what": "the active_learning pipeline run whole (load_pipeline(...).run; strategy random, 10 labels, "
                    f"1 fine-tuning epoch); an epoch = (t({EPOCHS[1]} epochs) - t({EPOCHS[0]})) / {EPOCHS[1] - EPOCHS[0]} of "
                    "one repetition's runs",
            "in_process": "the config naming the owners by their data: their gateways in this process; GatewayDpsgd",
            "gateways": "the same three served gateways: GatewayDpsgd, each step's keys and shares, charged at each "
                        "gateway",
            "order": f"interleaved: in-process, gateways at {EPOCHS[0]} epoch, then at {EPOCHS[1]}, each repetition",
            "run_seconds": {name: {str(e): [round(t, 3) for t in runs[e]] for e in EPOCHS}
                            for name, runs in dpsgd.items()},
            "epoch_seconds": {name: [round(t, 3) for t in values] for name, values in epoch.items()},
            "epoch_median_s": {name: round(statistics.median(values), 3) for name, values in epoch.items()},
            "ratio_of_medians": round(epoch_ratio, 3),
            "run_median_s": {name: {str(e): round(statistics.median(runs[e]), 3) for e in EPOCHS}
                             for name, runs in dpsgd.items()},
            "goal_met": epoch_ratio <= GOAL_RATIO,
        },
        "goal": f"a release and a DP-SGD epoch through gateways of their own each within {GOAL_RATIO:g}x of "
                "gateways in the run's own process",
        "goal_met": ratio <= GOAL_RATIO and epoch_ratio <= GOAL_RATIO,
        **timed_on(STAND_IN_DATA),
        **soundness([timed_private_work(STAND_IN_DATA)]),
    }
    RunDirectory(args.results_dir, "bench").write_json("gateway_overhead", result)
    log.info("release median: in-process %.1f ms, gateways %.1f ms (ratio %.2f); DP-SGD epoch median: in-process "
             "%.2f s, gateways %.2f s (ratio %.2f); goal <= %g: %s", medians["in_process"], medians["gateways"], ratio,
             result["dpsgd_epoch"]["epoch_median_s"]["in_process"], result["dpsgd_epoch"]["epoch_median_s"]["gateways"],
             epoch_ratio, GOAL_RATIO, result["goal_met"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
