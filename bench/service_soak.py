"""Benchmark: `conclave serve` soaked from outside — load, hostile traffic, SIGKILLs, a lost teacher.

Everything on 127.0.0.1, bounded in count and time. It starts the real CLI (`conclave serve`,
a process of its own, TLS off on loopback, a bearer token) on a small digits config with a
declared budget that runs out part-way, and meanwhile:

* 32 client threads each make 1,000 single-input Label calls, half on a "hot" set of 300
  inputs and half on 3,000 distinct ones, so repeats and fresh inputs mix and the budget is
  spent mid-run. A call the server could not take (UNAVAILABLE: restarting, busy, teachers
  down) is retried with backoff for up to two minutes; a budget refusal is final.
* one thread sends 5,000 malformed requests (random bytes, wrong shapes, dtypes, ranges);
* 16 authenticated LabelStreams stay open and idle, plus 8 unauthenticated reflection streams;
* a probe calls GetBudget every half second with a 2 s deadline and records ε;
* `serve` is SIGKILLed 5 times at set points of the load and restarted on the same ledger
  file and port; once, one teacher actor's process is SIGKILLed instead.

It writes results/bench/service_soak.json: requests and status codes, answers that changed
for a repeated input (must be 0), max realised ε against the declared budget, ledger charges
against distinct inputs answered, recovery times, p50/p99 latency of answered calls, Ray
processes left by killed runs (and stopped by the next start), the ledger's integrity, and
``sound`` as the server reports its guarantee.

    python bench/service_soak.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores, thread_settings  # noqa: E402  (before torch loads)

share_cores()

from conclave.actors.labeller import input_keys  # noqa: E402
from conclave.cluster.client import AggregatorClient, is_budget_refusal  # noqa: E402
from conclave.learning.data import load_digits  # noqa: E402
from conclave.protos import aggregator_pb2, aggregator_pb2_grpc  # noqa: E402

from bench.soundness import soundness  # noqa: E402

log = logging.getLogger("bench.service_soak")

TOKEN = "soak-token"
CONFIG = {
    "pipeline": "teacher_student", "name": "soak", "seed": 0,
    "data": {"name": "digits", "public_size": 400},
    "teachers": {"count": 10, "model": "digits_cnn", "train": {"epochs": 5, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "gnmax", "params": {"sigma": 40.0}},
    "privacy": {"budget": 6.0, "delta": 1.0e-5},
    "student": {"queries": 400, "batch_size": 8},
    "server": {"max_batch": 8},
}
RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


@dataclass(frozen=True)
class Plan:
    clients: int = 32
    queries: int = 1000
    malformed: int = 5000
    idle_streams: int = 16
    idle_reflection: int = 8
    kills_at: tuple[float, ...] = (0.1, 0.25, 0.4, 0.55, 0.7)  # fractions of all calls done
    teacher_kill_at: float = 0.85
    distinct: int = 3000
    hot: int = 300
    retry_for: float = 120.0
    time_limit: float = 1800.0


QUICK = Plan(clients=8, queries=100, malformed=500, idle_streams=4, idle_reflection=2, kills_at=(0.3,),
             teacher_kill_at=0.7, distinct=600, hot=60)


class Serve:
    """`conclave serve` as a child process on a fixed port and ledger, restartable after a SIGKILL."""

    def __init__(self, config: Path, ledger: Path, port: int, workdir: Path) -> None:
        self.config, self.ledger, self.port, self.workdir = config, ledger, port, workdir
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.reclaimed: list[int] = []  # Ray processes each start found left over (and stopped)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start and wait until it serves; returns the seconds that took."""
        started = time.monotonic()
        self.starts += 1
        err_path = self.workdir / f"serve-{self.starts}.err"
        env = {**os.environ, "CONCLAVE_TOKEN": TOKEN}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conclave.cluster.cli", "serve", str(self.config), "--port", str(self.port),
             "--ledger", str(self.ledger)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err_path.open("w"), text=True)
        for line in self.process.stdout:
            if line.startswith("aggregator serving on"):
                break
        else:
            raise RuntimeError(f"serve exited before serving; see {err_path}")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # keep the pipe drained
        found = re.findall(r"stopped (\d+) Ray processes", err_path.read_text())
        self.reclaimed.append(sum(int(count) for count in found))
        return time.monotonic() - started

    def kill(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed beyond what SQLite committed."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=120)

    def teacher_pids(self) -> list[int]:
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [c.pid for c in children if "TeacherGroup" in " ".join(_cmdline(c))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


@dataclass
class Tally:
    """What the clients saw; a lock guards it (client threads write concurrently)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    codes: Counter = field(default_factory=Counter)  # final outcome per Label call
    retries: int = 0
    latencies: list[float] = field(default_factory=list)  # answered calls, the successful attempt
    answers: dict[bytes, int] = field(default_factory=dict)
    changed: int = 0  # a repeated input answered differently: must never happen
    done: int = 0
    first_answer_after: float = 0.0  # monotonic time of the latest answered call

    def answered(self, key: bytes, label: int, latency: float) -> None:
        with self.lock:
            self.codes["OK"] += 1
            self.latencies.append(latency)
            previous = self.answers.setdefault(key, label)
            self.changed += previous != label
            self.done += 1
            self.first_answer_after = time.monotonic()

    def ended(self, code: str) -> None:
        with self.lock:
            self.codes[code] += 1
            self.done += 1


def universe(plan: Plan) -> np.ndarray:
    """``plan.distinct`` distinct valid inputs: digits test images, each copy marked in one pixel."""
    _, test = load_digits()
    images = test.x
    rows = []
    for i in range(plan.distinct):
        image = images[i % len(images)].copy()
        image.flat[0] = ((i // len(images)) + 1) / 64.0  # distinct bytes, still in [0, 1]
        rows.append(image)
    return np.stack(rows).astype(np.float32)


def client_loop(index: int, serve: Serve, inputs: np.ndarray, keys: list[bytes], plan: Plan, tally: Tally,
                stop: threading.Event) -> None:
    rng = random.Random(index)
    with AggregatorClient(serve.address, token=TOKEN, timeout=30) as client:
        for _ in range(plan.queries):
            if stop.is_set():
                return
            row = rng.randrange(plan.hot) if rng.random() < 0.5 else rng.randrange(plan.distinct)
            deadline, backoff = time.monotonic() + plan.retry_for, 0.05
            while True:
                started = time.perf_counter()
                try:
                    reply = client.label_reply(inputs[row : row + 1])
                except grpc.RpcError as err:
                    if is_budget_refusal(err):
                        tally.ended("RESOURCE_EXHAUSTED (budget)")
                        break
                    if err.code() in RETRYABLE and time.monotonic() < deadline and not stop.is_set():
                        with tally.lock:
                            tally.retries += 1
                        time.sleep(backoff)
                        backoff = min(2.0, backoff * 2)
                        continue
                    tally.ended(err.code().name)
                    break
                tally.answered(keys[row], int(reply.labels[0]), time.perf_counter() - started)
                break


def malformed_loop(serve: Serve, count: int, shape: tuple[int, ...], codes: Counter, stop: threading.Event) -> None:
    """Random bytes and wrong tensors; each sent until the server (up) gives a definite answer."""
    rng = np.random.default_rng(7)
    good = np.full((1, *shape), 0.5, dtype="<f4")
    makers = [
        lambda: rng.bytes(int(rng.integers(1, 4000))),
        lambda: aggregator_pb2.LabelRequest(inputs=aggregator_pb2.Tensor(
            shape=[1, 3, 3], dtype="float32", data=b"\0" * 36)).SerializeToString(),
        lambda: aggregator_pb2.LabelRequest(inputs=aggregator_pb2.Tensor(
            shape=[1, *shape], dtype="q" * int(rng.integers(1, 10_000)), data=good.tobytes())).SerializeToString(),
        lambda: aggregator_pb2.LabelRequest(inputs=aggregator_pb2.Tensor(
            shape=[1, *shape], dtype="float32", data=(good * 255).tobytes())).SerializeToString(),
    ]
    with grpc.insecure_channel(serve.address) as channel:
        label = channel.unary_unary("/conclave.v1.Aggregator/Label", request_serializer=None,
                                    response_deserializer=None)
        for i in range(count):
            request = makers[i % len(makers)]()
            while not stop.is_set():
                try:
                    label(request, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
                    codes["OK"] += 1  # must not happen
                    break
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.UNAVAILABLE:
                        time.sleep(0.2)
                        continue
                    codes[err.code().name] += 1
                    break


def idle_streams(serve: Serve, plan: Plan, ended: Counter, stop: threading.Event) -> None:
    """Keep ``plan.idle_streams`` idle LabelStreams (and some reflection streams) open, reopening
    each as the server closes it (idle timeout, restart); count how they ended."""

    def nothing():
        stop.wait()
        return
        yield

    while not stop.is_set():
        if wait_for(lambda: stop.is_set() or health_status(serve) == health_pb2.HealthCheckResponse.SERVING, 120, 0.2) \
                is None or stop.is_set():
            continue
        with grpc.insecure_channel(serve.address) as channel:
            stub = aggregator_pb2_grpc.AggregatorStub(channel)
            calls = [stub.LabelStream(nothing(), metadata=(("authorization", f"Bearer {TOKEN}"),))
                     for _ in range(plan.idle_streams)]
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            calls += [reflect.ServerReflectionInfo(nothing()) for _ in range(plan.idle_reflection)]
            for call in calls:
                try:
                    for _ in call:
                        pass
                    ended["OK"] += 1
                except grpc.RpcError as err:
                    ended[err.code().name] += 1
                    if stop.is_set():
                        break
            for call in calls:
                call.cancel()
        time.sleep(0.5)


@dataclass
class Probe:
    budget_seconds: list[float] = field(default_factory=list)
    over_two_seconds: int = 0  # GetBudget calls slower than 2 s (or failed) while health said SERVING
    max_epsilon: float = 0.0
    limit: float = float("inf")
    health: list[tuple[float, int]] = field(default_factory=list)


def probe_loop(serve: Serve, probe: Probe, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        with grpc.insecure_channel(serve.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                continue  # down (restarting)
            probe.health.append((time.monotonic(), status))
            if status != health_pb2.HealthCheckResponse.SERVING:
                continue
            started = time.perf_counter()
            try:
                reply = aggregator_pb2_grpc.AggregatorStub(channel).GetBudget(
                    aggregator_pb2.BudgetRequest(), timeout=2, metadata=(("authorization", f"Bearer {TOKEN}"),))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:  # killed between the two calls
                    probe.over_two_seconds += 1
                continue
            probe.budget_seconds.append(time.perf_counter() - started)
            probe.max_epsilon = max(probe.max_epsilon, reply.epsilon_spent)
            probe.limit = reply.epsilon_limit


def wait_for(condition, seconds: float, every: float = 0.05) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if condition():
            return time.monotonic() - started
        time.sleep(every)
    return None


def health_status(serve: Serve) -> int | None:
    with grpc.insecure_channel(serve.address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ledger_facts(path: Path) -> dict:
    with sqlite3.connect(path) as db:
        return {"integrity_check": db.execute("PRAGMA integrity_check").fetchone()[0],
                "charges": db.execute("SELECT COUNT(*) FROM charges").fetchone()[0],
                "answers": db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 clients × 100 calls, one kill")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "service_soak.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = QUICK if args.quick else Plan()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    config = workdir / "soak.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    serve = Serve(config, workdir / "ledger.sqlite", free_port(), workdir)
    inputs = universe(plan)
    keys = input_keys(inputs)
    total = plan.clients * plan.queries
    began = time.monotonic()

    first_start = serve.start()
    log.info("serve up on %s in %.1f s", serve.address, first_start)
    tally, probe, malformed, streams = Tally(), Probe(), Counter(), Counter()
    stop = threading.Event()
    threads = [threading.Thread(target=client_loop, args=(i, serve, inputs, keys, plan, tally, stop), daemon=True)
               for i in range(plan.clients)]
    threads += [threading.Thread(target=malformed_loop, args=(serve, plan.malformed, inputs.shape[1:], malformed, stop),
                                 daemon=True),
                threading.Thread(target=idle_streams, args=(serve, plan, streams, stop), daemon=True),
                threading.Thread(target=probe_loop, args=(serve, probe, stop), daemon=True)]
    for thread in threads:
        thread.start()

    restarts, teacher_kill = [], None
    for point in sorted([*plan.kills_at, plan.teacher_kill_at]):
        if wait_for(lambda: tally.done >= point * total, plan.time_limit - (time.monotonic() - began), 0.2) is None:
            log.warning("time limit: stopping before the kill at %.0f%%", 100 * point)
            break
        if point == plan.teacher_kill_at:
            victims = serve.teacher_pids()
            os.kill(victims[0], signal.SIGKILL)
            killed = time.monotonic()
            down = wait_for(lambda: health_status(serve) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, 0.02)
            up = wait_for(lambda: health_status(serve) == health_pb2.HealthCheckResponse.SERVING, 120, 0.1)
            teacher_kill = {"at_fraction": point, "not_serving_after_s": down,
                            "serving_again_after_s": None if up is None else time.monotonic() - killed}
            log.info("teacher killed: NOT_SERVING after %s s, SERVING again after %s s", down,
                     teacher_kill["serving_again_after_s"])
            continue
        killed_at_done = tally.done
        serve.kill()
        killed = time.monotonic()
        startup = serve.start()
        answered_since = wait_for(lambda: tally.first_answer_after > killed + startup, 120, 0.05)
        restarts.append({"at_fraction": point, "calls_done": killed_at_done, "restart_s": startup,
                         "first_answer_after_kill_s": None if answered_since is None else startup + answered_since,
                         "ray_processes_left_by_the_killed_run": serve.reclaimed[-1]})
        log.info("serve SIGKILLed at %d calls; serving again after %.1f s (%d Ray processes it left were stopped)",
                 killed_at_done, startup, serve.reclaimed[-1])

    remaining = plan.time_limit - (time.monotonic() - began)
    for thread in threads[:plan.clients + 1]:
        thread.join(timeout=max(1.0, remaining))
    stop.set()
    for thread in threads[plan.clients + 1:]:
        thread.join(timeout=30)
    final = AggregatorClient(serve.address, token=TOKEN).budget()
    exit_code = serve.stop()
    facts = ledger_facts(serve.ledger)
    from conclave.cluster.ray_runtime import reclaim_orphaned_ray

    left_at_end = reclaim_orphaned_ray()
    latencies = np.array(tally.latencies) * 1000
    out = {
        "benchmark": "service_soak",
        **soundness(list(final["guarantee"]["unsound_reasons"])
                    or [None if final["sound"] else "the server reports sound: false, without a reason"]),
        "quick": args.quick, "thread_settings": thread_settings(), "plan": plan.__dict__ | {"kills_at": list(plan.kills_at)},
        "config": CONFIG,
        "seconds": time.monotonic() - began,
        "label_calls": {"total": sum(tally.codes.values()), "planned": total, "by_final_status": dict(tally.codes),
                        "retries_while_unavailable": tally.retries},
        "answers_changed_for_a_repeated_input": tally.changed,
        "distinct_inputs_answered": len(tally.answers),
        "ledger": facts,
        "charges_per_distinct_input_answered": facts["charges"] / max(1, facts["answers"]),
        "epsilon": {"max_seen": probe.max_epsilon, "final_spent": final["epsilon_spent"], "limit": final["epsilon_limit"],
                    "guarantee": final["guarantee"]["epsilon"]},
        "latency_ms_answered": {"p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99)),
                                "max": float(latencies.max())},
        "get_budget": {"calls": len(probe.budget_seconds), "max_s": max(probe.budget_seconds, default=None),
                       "slower_than_2s_or_failed_while_serving": probe.over_two_seconds},
        "malformed": {"sent": plan.malformed, "by_status": dict(malformed)},
        "idle_streams": {"open_at_once": plan.idle_streams, "reflection_open_at_once": plan.idle_reflection,
                         "ended_by_status": dict(streams)},
        "restarts": restarts, "first_start_s": first_start, "teacher_kill": teacher_kill,
        "serve_exit_code_on_sigint": exit_code, "ray_processes_left_at_end": len(left_at_end),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"service soak: {out['label_calls']['total']} Label calls {dict(tally.codes)}; {len(tally.answers)} distinct "
          f"answered, {facts['charges']} charges; changed answers {tally.changed}; ε max {probe.max_epsilon:.3f} "
          f"of {final['epsilon_limit']:.3g}; p50/p99 {out['latency_ms_answered']['p50']:.1f}/"
          f"{out['latency_ms_answered']['p99']:.1f} ms; malformed {dict(malformed)}; {len(restarts)} restarts; "
          f"ledger {facts['integrity_check']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
