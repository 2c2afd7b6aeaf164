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

Then the failures of issue 28, each a scenario against `serve` processes of its own (small
digits configs; 4 to 5 minutes on 2 shared cores, with ``--quick`` too), each recording
what it measured and ``passed`` with its reason under ``scenarios``; the benchmark exits 1
if one fails:

1. health Watch flood: 32 unauthenticated health Watch streams, each opened again as it
   ends, for 5 s past the 60 s stream limit, while health Check, reflection and GetBudget
   are called four times a second and must all answer (their latency, the floods' codes);
2. hung teacher: one teacher actor's process SIGSTOPped for 20 s while 8 clients ask for
   fresh inputs with a 30 s deadline: every call fails UNAVAILABLE before it (the slowest
   recorded), health turns NOT_SERVING, ε spent and the answered count do not move; SIGCONT
   brings SERVING back and a fresh call is answered;
3. fourth kill: one teacher actor SIGKILLed 4 times, waiting for each restart (past Ray's
   three, the pool starts it again from its saved teachers): it serves again each time, and
   inputs answered before keep their labels, even while the actor is down;
4. bad TLS files (garbage certificate, a key of another certificate, garbage client CA):
   exit status 2 with one line on stderr, no ledger file, nothing in its own TMPDIR (Ray's
   session folder would be there) and no child process;
5. SIGKILL leftovers, with TMPDIR the bench's: the teachers' checkpoints sit in the run's
   0700 folder (``conclave-private-<uid>/<run>``); SIGKILL leaves it; the next start removes
   it and not two decoys (one without a marker, one whose marker names a live process);
   after a SIGINT stop no run folder remains and no process of the serve outlives it;
6. partial batch at the end of the budget (ε 1, on the first start of scenario 5's serve):
   20 inputs, then one batch of 64 new ones whose worst case exceeds what is left: answered
   up to the budget, the rest (the batch's last inputs) ``budget_refused``; inputs on record
   answered beside refused new ones; ε spent ≤ the budget.

Then the faults of issue 36, against serve processes of their own too:

7. signed-zero re-ask: 16 inputs answered, then asked with every 0.0 spelt -0.0: the record's
   labels, no charge (before: fresh noise, charged again);
8. kNN actor kill: on kNN votes (digits), one kNN actor SIGKILLed 4 times while 4 clients ask
   fresh inputs: NOT_SERVING then SERVING each time, fresh inputs answered again, the fourth
   replaced past Ray's restarts (before: NOT_SERVING for good);
9. stopped secure owner: the three hospitals with ``aggregation: secure``, one owner's actor
   SIGSTOPped for 20 s under 4 clients: every call UNAVAILABLE within the 30 s deadline (before:
   DEADLINE_EXCEEDED after 300 s rounds), no input recorded as answered that no client got, at
   most the round in flight at the stop charged with no answer, SERVING after SIGCONT;
10. full disk: the ledger on a 2 MiB tmpfs in a private mount namespace (``unshare``), filled
    until ENOSPC: fresh inputs UNAVAILABLE naming the disk (before: INTERNAL), nothing charged,
    inputs on record answered, a few log lines; space freed, answered again.

Then the findings of issue 51, against serve processes of their own:

11. cluster-vote serve: the demo's public-cluster votes (configs/demo.yaml, a declared budget of
    20) under 6 concurrent clients, 4 calls of 8 new inputs each: every call answered, each one
    charge paying for that call's inputs alone (the ledger's answers, by charge), never merged
    with another client's (before: serve crashed on every public-cluster config, and calls were
    merged, so one client's labels depended on another's inputs); each client's first call asked
    again: the record's labels, no charge; health SERVING; ε within the budget;
12. record-write failure (R22): on kNN votes, a file where ``$CONCLAVE_HOME/ledgers`` (the
    ledger's record) should be: 5 fresh calls ``UNAVAILABLE`` saying nothing was charged, and the
    ledger's charges do not move (before: told so while charged 5 → 10); inputs on record
    answered; the folder mended: one charge per fresh input, asked again free and alike.

    python bench/service_soak.py [--quick] [--out PATH]
    python bench/service_soak.py --only knn_actor_kill,full_disk   # those scenarios, no load:
                                                                    # results/bench/service_soak_scenarios.json
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import re
import shutil
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
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores, thread_settings  # noqa: E402  (before torch loads)

share_cores()

from conclave.cluster.api import AggregatorClient, input_keys, is_budget_refusal  # noqa: E402
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

    def __init__(self, config: Path, ledger: Path, port: int, workdir: Path, name: str = "serve",
                 env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()) -> None:
        self.config, self.ledger, self.port, self.workdir = config, ledger, port, workdir
        self.name, self.env = name, env or {}  # env: added to this process's (e.g. TMPDIR)
        self.wrapper = wrapper  # a command serve runs under, which execs it (its PID is serve's)
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.reclaimed: list[int] = []  # Ray processes each start found left over (and stopped)
        self.err_path: Path | None = None  # the latest start's stderr

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start and wait until it serves; returns the seconds that took."""
        started = time.monotonic()
        self.starts += 1
        err_path = self.err_path = self.workdir / f"{self.name}-{self.starts}.err"
        env = {**os.environ, **self.env, "CONCLAVE_TOKEN": TOKEN}
        self.process = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "conclave.cluster.cli", "serve", str(self.config),
             "--port", str(self.port), "--ledger", str(self.ledger)],
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

    def descendants(self) -> list[psutil.Process]:
        """Every process this serve started (Ray's included), while it runs."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def teacher_pids(self) -> list[int]:
        return self.actor_pids("TeacherGroup")

    def actor_pids(self, actor_class: str) -> list[int]:
        """The processes of this serve's actors of ``actor_class`` (``TeacherGroup``, ``KnnShard``)."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [c.pid for c in children if actor_class in " ".join(_cmdline(c))]


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
    return marked_inputs(0, plan.distinct)


def marked_inputs(start: int, count: int) -> np.ndarray:
    """Inputs ``start`` .. ``start + count - 1`` of one sequence of distinct valid inputs: copy
    ``i // n`` of digits test image ``i % n``, marked in a corner pixel (0 in every image)."""
    _, test = load_digits()
    images = test.x
    if (start + count - 1) // len(images) + 1 > 64:
        raise ValueError(f"only {64 * len(images)} marked inputs exist")
    rows = []
    for i in range(start, start + count):
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


_HEALTH_CHANNELS: dict[str, grpc.Channel] = {}


def health_status(serve: Serve) -> int | None:
    """The server's health, or None when the check fails. One channel per address, kept open:
    a fresh connection per check, from a process running 32 busy clients, missed whole
    NOT_SERVING spells (the server's log had them)."""
    channel = _HEALTH_CHANNELS.get(serve.address)
    if channel is None:  # reconnecting fast after a restart on the same port, as AggregatorClient does
        channel = _HEALTH_CHANNELS[serve.address] = grpc.insecure_channel(
            serve.address, [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)])
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
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


# ---- the failures of issue 28, one scenario each, against serve processes of their own ----

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# Scenarios 1-3: a budget fresh calls do not exhaust, so every refusal there is the failure's.
SCENARIO_CONFIG = {**CONFIG, "name": "soak-scenarios", "privacy": {"budget": 100.0, "delta": 1.0e-5}}
# Scenarios 5-6: a budget that pays for 48 new inputs in the worst case (GNMax, σ = 40).
PARTIAL_CONFIG = {**CONFIG, "name": "soak-partial", "privacy": {"budget": 1.0, "delta": 1.0e-5},
                  "student": {"queries": 40, "batch_size": 8}, "server": {"max_batch": 64}}
DEADLINE = 30.0  # the clients' deadline (AggregatorClient's default)


@dataclass
class Outcome:
    """One scenario: what it measured, and each check that failed (none: it passed)."""

    measured: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, holds: bool, problem: str) -> None:
        if not holds:
            self.problems.append(problem)

    def as_dict(self) -> dict:
        return {"passed": not self.problems, "reason": "; ".join(self.problems) or "every check held",
                **self.measured}


def scenario(name: str, run, *args) -> Outcome:
    """Run one scenario; one that breaks fails with the error as its reason, and the next runs."""
    started, outcome = time.monotonic(), Outcome()
    log.info("scenario %s", name)
    try:
        run(outcome, *args)
    except Exception as err:
        log.exception("scenario %s broke", name)
        outcome.problems.append(f"the scenario broke: {type(err).__name__}: {err}")
    outcome.measured["seconds"] = round(time.monotonic() - started, 1)
    log.info("scenario %s: %s", name, outcome.as_dict()["reason"])
    return outcome


def ms(seconds: list[float]) -> dict:
    """p50 / p99 / max of call times, in ms."""
    if not seconds:
        return {"calls": 0}
    values = np.array(seconds) * 1000
    return {"calls": len(values), "p50": round(float(np.percentile(values, 50)), 2),
            "p99": round(float(np.percentile(values, 99)), 2), "max": round(float(values.max()), 2)}


def watch_flood(outcome: Outcome, serve: Serve, streams: int = 32) -> None:
    """32 unauthenticated health Watch streams, each opened again as soon as it ends, for longer
    than the idle limit; meanwhile health Check, reflection and GetBudget must keep answering."""
    from conclave.cluster.api import SERVICE_NAME, ServerSettings

    idle = ServerSettings().stream_idle_timeout  # what serve runs with (the config does not set it)
    hold = idle + 5.0
    lock, stop = threading.Lock(), threading.Event()
    codes, closed_at_age = Counter(), []
    open_now, peak = [0], [0]
    current: list[grpc.Call | None] = [None] * streams  # each flood thread's open Watch

    def flood(index: int) -> None:
        with grpc.insecure_channel(serve.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                call = current[index] = stub.Watch(health_pb2.HealthCheckRequest())
                opened, seen = time.monotonic(), False
                try:
                    for _ in call:
                        if not seen:
                            seen = True
                            with lock:
                                open_now[0] += 1
                                peak[0] = max(peak[0], open_now[0])
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with lock:
                    open_now[0] -= seen
                    if not stop.is_set():  # the bench's own cancel at the end is not the server's answer
                        codes[code] += 1
                        if seen and code == "DEADLINE_EXCEEDED":
                            closed_at_age.append(time.monotonic() - opened)
                if code != "DEADLINE_EXCEEDED":
                    stop.wait(0.2)  # refused: ask again soon, as a flood would

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    times: dict[str, list[float]] = {"health_check": [], "reflection": [], "get_budget": []}
    failed = Counter()
    listed_ok = True
    began = time.monotonic()
    while time.monotonic() - began < hold:
        with grpc.insecure_channel(serve.address) as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            budget_stub = aggregator_pb2_grpc.AggregatorStub(channel)
            calls = {
                "health_check": lambda: health_stub.Check(health_pb2.HealthCheckRequest(), timeout=2),
                "reflection": lambda: [service.name for reply in reflect.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=2)
                    for service in reply.list_services_response.service],
                "get_budget": lambda: budget_stub.GetBudget(aggregator_pb2.BudgetRequest(), timeout=2, metadata=AUTH),
            }
            for name, call in calls.items():
                started = time.perf_counter()
                try:
                    reply = call()
                except grpc.RpcError as err:
                    failed[f"{name}: {err.code().name}"] += 1
                    continue
                times[name].append(time.perf_counter() - started)
                if name == "reflection":
                    listed_ok = listed_ok and SERVICE_NAME in reply
        time.sleep(0.25)
    stop.set()
    for call in current:
        if call is not None:
            call.cancel()
    for thread in threads:
        thread.join(timeout=10)
    outcome.measured.update({
        "watch_streams_asked": streams, "held_for_s": round(time.monotonic() - began, 1), "idle_limit_s": idle,
        # as the flood threads count them: a stream the server just closed may still count, so +1 at most
        "watch_open_at_once_max_seen_by_clients": peak[0], "watch_ended_by_status": dict(codes),
        "watch_closed_by_server_at_age_s": [round(min(closed_at_age), 1), round(max(closed_at_age), 1)]
        if closed_at_age else None,
        "latency_ms": {name: ms(values) for name, values in times.items()}, "failed_calls": dict(failed),
    })
    outcome.check(not failed, f"calls failed during the flood: {dict(failed)}")
    outcome.check(all(times.values()), "a kind of call never answered")
    outcome.check(listed_ok, "reflection did not list the Aggregator service")
    outcome.check(peak[0] > 0, "no Watch stream was ever open: the flood did not hold anything")
    outcome.check(bool(closed_at_age), f"no Watch stream was closed at the {idle:g} s limit while held")
    outcome.check(health_status(serve) == SERVING, "health is not SERVING after the flood")


def hung_teacher(outcome: Outcome, serve: Serve, stop_for: float = 20.0, clients: int = 8) -> None:
    """One teacher actor stopped (SIGSTOP) for ``stop_for`` s while clients ask for fresh inputs
    with a 30 s deadline: each call fails UNAVAILABLE before it, health turns NOT_SERVING,
    nothing is charged; SIGCONT brings SERVING back."""
    from conclave.cluster.api import TeacherPool

    inputs = marked_inputs(0, 1000)  # nothing of them is on this ledger
    rows = iter(range(len(inputs)))
    rows_lock = threading.Lock()

    def fresh_row() -> np.ndarray:
        with rows_lock:
            row = next(rows)
        return inputs[row : row + 1]

    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        client.label(fresh_row())  # the teachers answer before the stop
        before = client.budget()
        victim = serve.teacher_pids()[0]
        calls, health_seen, done = [], [], threading.Event()
        calls_lock = threading.Lock()

        def caller() -> None:
            while time.monotonic() - stopped < stop_for:
                started = time.monotonic()
                try:
                    client.label(fresh_row())
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with calls_lock:
                    calls.append((started - stopped, time.monotonic() - started, code))
                time.sleep(0.25)

        def watch_health() -> None:
            while not done.is_set():
                health_seen.append((time.monotonic() - stopped, health_status(serve)))
                done.wait(0.05)

        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            threads = [threading.Thread(target=caller, daemon=True) for _ in range(clients)]
            threads.append(threading.Thread(target=watch_health, daemon=True))
            for thread in threads:
                thread.start()
            for thread in threads[:-1]:  # each call ends by its deadline; all before SIGCONT
                thread.join(timeout=stop_for + DEADLINE + 5)
            still_calling = sum(thread.is_alive() for thread in threads[:-1])
            during = client.budget()
            stopped_for = time.monotonic() - stopped
        finally:
            os.kill(victim, signal.SIGCONT)
        serving_after = wait_for(lambda: health_status(serve) == SERVING, 60, 0.05)
        done.set()
        after = client.budget()
        try:
            client.label(fresh_row())
            fresh_after = "OK"
        except grpc.RpcError as err:
            fresh_after = err.code().name
    not_serving = next((at for at, status in health_seen if status == NOT_SERVING), None)
    seconds = [took for _, took, _ in calls]
    codes = Counter(code for _, _, code in calls)
    slow = [{"started_after_stop_s": round(at, 2), "took_s": round(took, 2), "status": code}
            for at, took, code in calls if took > TeacherPool.vote_timeout_s / 2]
    outcome.measured.update({
        "stopped_for_s": round(stopped_for, 1), "clients": clients, "client_deadline_s": DEADLINE,
        "vote_timeout_s": TeacherPool.vote_timeout_s, "calls_by_status": dict(codes),
        "slowest_call_s": round(max(seconds), 2) if seconds else None, "call_latency_ms": ms(seconds),
        "calls_slower_than_half_the_vote_timeout": slow,
        "not_serving_after_stop_s": None if not_serving is None else round(not_serving, 2),
        "serving_after_sigcont_s": None if serving_after is None else round(serving_after, 2),
        "epsilon_spent": {"before": before["epsilon_spent"], "while_stopped": during["epsilon_spent"],
                          "after": after["epsilon_spent"]},
        "queries_answered": {"before": before["queries_answered"], "after": after["queries_answered"]},
        "fresh_call_after_recovery": fresh_after,
    })
    outcome.check(bool(calls) and set(codes) == {"UNAVAILABLE"}, f"calls to a stopped teacher ended {dict(codes)}, "
                  "not all UNAVAILABLE")
    outcome.check(not still_calling and bool(seconds) and max(seconds) < DEADLINE,
                  f"a call ran to the client's {DEADLINE:g} s deadline")
    outcome.check(not_serving is not None, "health never went NOT_SERVING while the teacher was stopped")
    outcome.check(before["epsilon_spent"] == during["epsilon_spent"] == after["epsilon_spent"]
                  and before["queries_answered"] == after["queries_answered"], "the failed calls were charged")
    outcome.check(serving_after is not None, "health did not return to SERVING within 60 s of SIGCONT")
    outcome.check(fresh_after == "OK", f"a fresh call after recovery ended {fresh_after}")


def labels_of(client: AggregatorClient, inputs: np.ndarray, batch: int = 8) -> np.ndarray | str:
    """The labels of ``inputs`` (in batches), or the status code of the first call that failed."""
    try:
        return np.concatenate([client.label(inputs[i : i + batch]) for i in range(0, len(inputs), batch)])
    except grpc.RpcError as err:
        return err.code().name


def fourth_kill(outcome: Outcome, serve: Serve, kills: int = 4) -> None:
    """One teacher actor SIGKILLed ``kills`` times (Ray restarts it three times; then the pool
    starts it again from its saved teachers): the service serves again after each, and inputs
    answered before keep their labels, even while the actor is down."""
    inputs = marked_inputs(1000, 24)
    known = inputs[:16]
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        answered = labels_of(client, known)
        if isinstance(answered, str):
            outcome.problems.append(f"labelling the inputs before the kills failed: {answered}")
            return
        pids = serve.teacher_pids()
        victim, others = min(pids), set(pids) - {min(pids)}
        rounds = []
        for kill in range(1, kills + 1):
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            repeated = labels_of(client, known)  # at once: the actor is down, the record answers
            down = wait_for(lambda: health_status(serve) == NOT_SERVING, 30, 0.02)
            up = wait_for(lambda: health_status(serve) == SERVING, 180, 0.1)
            back = None if up is None else time.monotonic() - killed
            new = set(serve.teacher_pids()) - others
            rounds.append({"kill": kill, "pid": victim, "not_serving_after_s": None if down is None else round(down, 2),
                           "serving_again_after_s": None if back is None else round(back, 1),
                           "answered_inputs_while_down": repeated if isinstance(repeated, str)
                           else "same labels" if np.array_equal(repeated, answered) else "changed"})
            if up is None:
                outcome.problems.append(f"after kill {kill}: not SERVING again within 180 s")
                break
            if len(new) != 1:
                outcome.problems.append(f"after kill {kill}: {len(new)} new teacher processes, not 1")
                break
            victim = new.pop()
        fresh = labels_of(client, inputs[16:24])
        again = labels_of(client, known)
    replaced = serve.err_path.read_text().count("is gone for good")
    outcome.measured.update({
        "kills": rounds, "replacements_logged": replaced,
        "fresh_call_after_the_last_kill": fresh if isinstance(fresh, str) else "OK",
        "answered_inputs_after": again if isinstance(again, str)
        else "same labels" if np.array_equal(again, answered) else "changed",
    })
    outcome.check(len(rounds) == kills and all(r["serving_again_after_s"] is not None for r in rounds),
                  "the service did not serve again after every kill")
    outcome.check(all(r["answered_inputs_while_down"] == "same labels" for r in rounds),
                  "inputs answered before were not answered the same while the actor was down")
    outcome.check(replaced >= 1, "no replacement past Ray's restarts was logged")
    outcome.check(not isinstance(fresh, str), f"fresh inputs after the last kill: {fresh}")
    outcome.check(outcome.measured["answered_inputs_after"] == "same labels",
                  f"inputs answered before, after the kills: {outcome.measured['answered_inputs_after']}")


def bad_tls(outcome: Outcome, workdir: Path, within: float = 20.0) -> None:
    """``serve`` with TLS files that cannot work: exit status 2 and one line on stderr, before any
    ledger is made or Ray starts (TMPDIR of its own: nothing appears in it, no child process).
    ``within``: 2.5 s on an idle machine, 10 s seen with the 2 cores shared; the training a
    start reaches otherwise takes longer, and that nothing started is checked directly."""
    from conclave.cluster.api import create_authority, issue

    certs = workdir / "certs"
    server = issue(create_authority(certs / "ca", days=1), certs / "server", ("127.0.0.1",), name="server", days=1)
    other = issue(create_authority(certs / "other-ca", days=1), certs / "other", ("127.0.0.1",), days=1)
    garbage = certs / "garbage.pem"
    garbage.write_text("not a certificate\n")
    config = workdir / "tls.yaml"
    config.write_text(yaml.safe_dump(SCENARIO_CONFIG))
    cases = {
        "garbage certificate": ["--tls-cert", garbage, "--tls-key", server.key],
        "key of another certificate": ["--tls-cert", server.certificate, "--tls-key", other.key],
        "garbage client CA": ["--tls-cert", server.certificate, "--tls-key", server.key, "--tls-client-ca", garbage],
    }
    runs = {}
    for index, (case, flags) in enumerate(cases.items()):
        temp, ledger = workdir / f"tls-tmp-{index}", workdir / f"tls-ledger-{index}.sqlite"
        temp.mkdir()
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "conclave.cluster.cli", "serve", str(config), "--port", str(free_port()),
             "--ledger", str(ledger), *map(str, flags)],
            cwd=ROOT, env={**os.environ, "TMPDIR": str(temp), "CONCLAVE_TOKEN": TOKEN},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        children: set[str] = set()
        while process.poll() is None and time.monotonic() - started < 60:
            try:
                children.update(child.name() for child in psutil.Process(process.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.02)
        if process.poll() is None:
            process.kill()
        stdout, stderr = process.communicate()
        seconds = time.monotonic() - started
        lines = [line for line in stderr.splitlines() if line.strip()]
        runs[case] = {"exit_status": process.returncode, "seconds": round(seconds, 2), "stderr": lines,
                      "stdout_lines": len(stdout.splitlines()), "ledger_created": ledger.exists(),
                      "left_in_its_temp_dir": sorted(os.listdir(temp)), "child_processes": sorted(children)}
        problem = [what for what, failed in (
            (f"exit status {process.returncode}", process.returncode != 2),
            (f"{len(lines)} stderr lines", len(lines) != 1), (f"{seconds:.1f} s", seconds > within),
            ("a ledger file", ledger.exists()), (f"Ray's files {sorted(os.listdir(temp))}", any(temp.iterdir())),
            (f"child processes {sorted(children)}", bool(children))) if failed]
        outcome.check(not problem, f"{case}: {', '.join(problem)}")
    outcome.measured["runs"] = runs


def private_folders(base: Path, decoys: tuple[str, ...]) -> list[Path]:
    """The run folders under ``base`` (not the bench's decoys)."""
    return sorted(p for p in base.iterdir() if p.name not in decoys) if base.is_dir() else []


def plant_decoys(base: Path) -> tuple[str, ...]:
    """Two folders no start may remove: one without a marker, one whose marker names a live
    process (this one)."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    unmarked, live = base / "decoy-unmarked", base / "decoy-live"
    unmarked.mkdir(mode=0o700)
    (unmarked / "keep.txt").write_text("not a run's\n")
    live.mkdir(mode=0o700)
    me = psutil.Process()
    (live / f".owner-{me.pid}.json").write_text(json.dumps(
        {"run": live.name, "host": socket.gethostname(), "pid": me.pid, "create_time": me.create_time()}))
    return unmarked.name, live.name


def sigkill_leftovers(outcome: Outcome, serve: Serve, base: Path, decoys: tuple[str, ...]) -> None:
    """With TMPDIR the bench's: the running serve keeps its teachers' checkpoints in a private
    run folder; SIGKILLed, it leaves the folder; the next start removes it (and only it); after
    a clean SIGINT stop no run folder remains."""
    first = private_folders(base, decoys)
    checkpoints = sorted(p.name for folder in first for p in folder.glob("teacher-*.pt"))
    modes = sorted({oct(folder.stat().st_mode & 0o777) for folder in [base, *first]})
    teachers = [psutil.Process(pid) for pid in serve.teacher_pids()]
    serve.kill()
    _, alive = psutil.wait_procs(teachers, timeout=15)
    left = private_folders(base, decoys)
    left_checkpoints = sum(1 for folder in left for _ in folder.glob("teacher-*.pt"))
    serve.start()
    second = private_folders(base, decoys)
    running = serve.descendants()
    exit_status = serve.stop()
    _, outliving = psutil.wait_procs(running, timeout=15)
    after_stop = private_folders(base, decoys)
    kept = [name for name in decoys if (base / name).is_dir()]
    outcome.measured.update({
        "temp_dir": str(base.parent), "run_folders_while_serving": [p.name for p in first],
        "checkpoints_while_serving": len(checkpoints), "folder_modes": modes,
        "teacher_processes_alive_15s_after_sigkill": len(alive),
        "left_by_sigkill": {"run_folders": [p.name for p in left], "checkpoints": left_checkpoints},
        "ray_processes_the_next_start_stopped": serve.reclaimed[-1],
        "run_folders_after_next_start": [p.name for p in second],
        "serve_exit_status_on_sigint": exit_status, "processes_outliving_sigint_15s": len(outliving),
        "run_folders_after_sigint": [p.name for p in after_stop], "decoys_kept": kept,
    })
    outcome.check(len(first) == 1 and len(checkpoints) > 0, f"while serving: {len(first)} run folders, "
                                                             f"{len(checkpoints)} checkpoints")
    outcome.check(modes == ["0o700"], f"folder modes {modes}, not 0700")
    outcome.check([p.name for p in left] == [p.name for p in first] and left_checkpoints > 0,
                  "SIGKILL did not leave the run folder (nothing to reclaim: the scenario proves nothing)")
    outcome.check(len(second) == 1 and second[0].name not in {p.name for p in first},
                  f"after the next start: run folders {[p.name for p in second]}")
    outcome.check(kept == list(decoys), f"a start removed folders not its own: kept only {kept}")
    outcome.check(exit_status == 0 and not after_stop, f"after SIGINT: exit {exit_status}, run folders "
                                                        f"{[p.name for p in after_stop]}")
    outcome.check(not outliving, f"{len(outliving)} processes of serve outlived its SIGINT stop by 15 s")


def partial_batch(outcome: Outcome, serve: Serve) -> None:
    """A small budget, part spent; one batch of 64 new inputs whose worst case exceeds what is
    left: answered up to the budget, the rest ``budget_refused``; never over the budget."""
    inputs = marked_inputs(2000, 100)
    with AggregatorClient(serve.address, token=TOKEN, timeout=60) as client:
        first = client.label_reply(inputs[:20])
        left_before = client.budget()
        big = client.label_reply(inputs[20:84])
        mixed = client.label_reply(np.concatenate([inputs[20:28], inputs[84:92]]))
        try:
            last = client.label_reply(inputs[92:100])
            last_outcome = f"{int((~last.refused).sum())} answered, {int(last.refused.sum())} refused"
        except grpc.RpcError as err:
            last_outcome = "RESOURCE_EXHAUSTED (budget)" if is_budget_refusal(err) else err.code().name
        final = client.budget()
    paid = int((~big.refused).sum())
    limit = final["epsilon_limit"]
    outcome.measured.update({
        "budget": limit, "first_batch": {"inputs": 20, "refused": int(first.refused.sum())},
        "epsilon_spent_before_the_batch": left_before["epsilon_spent"],
        "batch": {"inputs": 64, "answered_or_abstained": paid, "budget_refused": int(big.refused.sum()),
                  "labels": int(big.answered)},
        "mixed_batch_8_on_record_8_new": {"refused": mixed.refused.astype(int).tolist(),
                                          "on_record_same_labels": bool(np.array_equal(
                                              mixed.labels[:8], big.labels[:8]))},
        "8_new_after": last_outcome, "epsilon_spent_final": final["epsilon_spent"],
        "guarantee_epsilon": final["guarantee"]["epsilon"],
    })
    outcome.check(not first.refused.any(), "the first batch of 20 was refused in part")
    outcome.check(0 < paid < 64, f"the batch of 64 was answered for {paid}: not in part")
    outcome.check(big.refused.tolist() == [False] * paid + [True] * (64 - paid), "the refused inputs are not the "
                  "batch's last ones")
    outcome.check(bool((big.labels[big.refused] == -1).all()), "a refused input got a label")
    outcome.check(paid < 8 or (np.array_equal(mixed.labels[:8], big.labels[:8]) and not mixed.refused[:8].any()),
                  "inputs on record were not answered the same in a batch with new ones")
    outcome.check(final["epsilon_spent"] <= limit and final["guarantee"]["epsilon"] <= limit,
                  f"ε spent {final['epsilon_spent']} over the budget {limit}")


# ---- the service faults of issue 36, one scenario each ----

# kNN votes on digits (no teachers to train), with room for every call the scenario makes.
KNN_CONFIG = {**yaml.safe_load((ROOT / "configs" / "digits-knn.yaml").read_text()), "name": "soak-knn",
              "privacy": {"budget": 100.0, "delta": 1.0e-5}, "server": {"max_batch": 64}}
# The three hospitals with aggregation: secure, 3 teachers each; room for every call, in the rounds
# the owners admit (each call one round), in the run's budget and in each owner's lifetime one
# (their ledgers under the bench's own CONCLAVE_HOME).
_HOSPITALS = yaml.safe_load((ROOT / "configs" / "hospitals.yaml").read_text())
SECURE_CONFIG = {**_HOSPITALS, "name": "soak-secure", "aggregation": "secure",
                 "owners": [{**owner, "teachers": 3, "budget": {"epsilon": 1000.0, "delta": 1.0e-5}}
                            for owner in _HOSPITALS["owners"]],
                 "student": {**_HOSPITALS["student"], "queries": 120, "batch_size": 1},  # 120 rounds of 1
                 "privacy": {"budget": 200.0, "delta": 1.0e-5}, "server": {"max_batch": 64}}
STORAGE_FULL = "the aggregator cannot write its privacy ledger (disk full)"


def signed_zero_reask(outcome: Outcome, serve: Serve) -> None:
    """Inputs answered once, then asked again with every 0.0 written as -0.0 (other bytes, the
    same image): the record's answers, at no cost — not a second draw of the noise."""
    inputs = marked_inputs(3000, 16)
    signed = inputs.copy()
    signed[signed == 0] = -0.0
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        first = labels_of(client, inputs)
        before = client.budget()
        again = labels_of(client, signed)
        after = client.budget()
    changed = int(np.sum(np.signbit(signed) & ~np.signbit(inputs)))
    outcome.measured.update({
        "inputs": len(inputs), "zeros_written_as_minus_zero": changed,
        "labels_again": "failed: " + again if isinstance(again, str) else
        "same labels" if np.array_equal(first, again) else "changed",
        "epsilon_spent": {"after_first_ask": before["epsilon_spent"], "after_re_ask": after["epsilon_spent"]},
        "cache_hits_added": after["cache_hits"] - before["cache_hits"],
    })
    outcome.check(not isinstance(first, str) and changed > 0, "the first ask failed, or nothing was re-spelt")
    outcome.check(outcome.measured["labels_again"] == "same labels", f"re-ask: {outcome.measured['labels_again']}")
    outcome.check(after["epsilon_spent"] == before["epsilon_spent"], "the re-ask was charged")
    outcome.check(after["cache_hits"] - before["cache_hits"] == len(inputs), "the re-ask was not served from the record")


class Callers:
    """``clients`` threads asking fresh single inputs (``next_input``) with the clients' 30 s
    deadline until stopped, each ``pause`` s apart; each call's start, duration and status."""

    def __init__(self, serve: Serve, next_input, clients: int, pause: float = 0.0) -> None:
        self._pause = pause
        self.calls: list[tuple[float, float, str]] = []
        self.answered_inputs = 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._call, args=(serve, next_input), daemon=True)
                         for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _call(self, serve: Serve, next_input) -> None:
        with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
            while not self._stop.is_set():
                row = next_input()
                started = time.monotonic()
                try:
                    client.label(row)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with self._lock:
                    self.calls.append((started, time.monotonic() - started, code))
                    self.answered_inputs += code == "OK"
                time.sleep(self._pause if code == "OK" else max(self._pause, 0.2))  # a client backs off a little

    def stop(self) -> int:
        """Stop asking; how many callers were still in a call after their deadline and 5 s."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=DEADLINE + 5)
        return sum(thread.is_alive() for thread in self._threads)

    def summary(self) -> dict:
        seconds = [took for _, took, _ in self.calls]
        return {"calls_by_status": dict(Counter(code for _, _, code in self.calls)),
                "slowest_call_s": round(max(seconds), 2) if seconds else None, "call_latency_ms": ms(seconds)}


def knn_actor_kill(outcome: Outcome, serve: Serve, kills: int = 4, clients: int = 4, serving_for: float = 3.0) -> None:
    """One kNN actor SIGKILLed ``kills`` times while clients ask fresh inputs (Ray restarts it
    three times; past those the vote source starts it again): each time health turns NOT_SERVING
    and comes back to SERVING, and fresh inputs are answered again. Before: NOT_SERVING for good."""
    inputs = marked_inputs(4000, 4000)
    rows, rows_lock = iter(range(len(inputs))), threading.Lock()

    def next_input() -> np.ndarray:
        with rows_lock:
            row = next(rows)
        return inputs[row : row + 1]

    known = marked_inputs(3500, 8)
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        answered = labels_of(client, known)
        if isinstance(answered, str):
            outcome.problems.append(f"labelling before the kills failed: {answered}")
            return
        callers = Callers(serve, next_input, clients)
        pids = serve.actor_pids("KnnShard")
        victim, others = min(pids), set(pids) - {min(pids)}
        rounds = []
        for kill in range(1, kills + 1):
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            repeated = labels_of(client, known)
            down = wait_for(lambda: health_status(serve) == NOT_SERVING, 30, 0.02)
            up = wait_for(lambda: health_status(serve) == SERVING, 180, 0.1)
            back = None if up is None else time.monotonic() - killed
            fresh = labels_of(client, next_input())
            time.sleep(serving_for)  # the clients are answered again before the next kill
            new = set(serve.actor_pids("KnnShard")) - others
            rounds.append({"kill": kill, "not_serving_after_s": None if down is None else round(down, 2),
                           "serving_again_after_s": None if back is None else round(back, 1),
                           "answered_inputs_while_down": repeated if isinstance(repeated, str)
                           else "same labels" if np.array_equal(repeated, answered) else "changed",
                           "fresh_input_after": fresh if isinstance(fresh, str) else "OK"})
            if up is None or len(new) != 1:
                outcome.problems.append(f"after kill {kill}: serving again {up is not None}, {len(new)} new kNN "
                                        "processes")
                break
            victim = new.pop()
        still_calling = callers.stop()
    replaced = serve.err_path.read_text().count("kNN actor 0 is gone for good")
    outcome.measured.update({"kills": rounds, "kNN_actors": len(pids), "replacements_logged": replaced,
                             "clients": clients, **callers.summary()})
    codes = set(outcome.measured["calls_by_status"])
    outcome.check(len(rounds) == kills and all(r["serving_again_after_s"] is not None for r in rounds),
                  "the service did not serve again after every kill")
    outcome.check(all(r["not_serving_after_s"] is not None for r in rounds), "health missed a NOT_SERVING")
    outcome.check(all(r["fresh_input_after"] == "OK" for r in rounds), "a fresh input after a recovery failed")
    outcome.check(all(r["answered_inputs_while_down"] == "same labels" for r in rounds),
                  "inputs answered before were not answered the same while the actor was down")
    outcome.check(replaced >= 1, "no replacement past Ray's restarts was logged")
    outcome.check(codes <= {"OK", "UNAVAILABLE"} and not still_calling, f"calls ended {codes}")
    outcome.check("OK" in codes, "the clients' fresh inputs were never answered between the kills")


def stopped_secure_owner(outcome: Outcome, serve: Serve, stop_for: float = 20.0, clients: int = 4) -> None:
    """aggregation: secure, one owner's teacher actor SIGSTOPped for ``stop_for`` s while clients
    ask fresh rows with the 30 s deadline: every call ends UNAVAILABLE before it (before: 300 s
    rounds, DEADLINE_EXCEEDED), nothing is recorded as answered that no client got, a round in
    flight at the stop (its shares asked) is charged, and SIGCONT brings SERVING back."""
    public = np.genfromtxt(ROOT / "examples/hospitals/data/public/unlabeled.csv", delimiter=",", skip_header=1,
                           dtype=np.float32)
    counter, counter_lock = iter(range(1, 1_000_000)), threading.Lock()

    def next_input() -> np.ndarray:
        with counter_lock:
            i = next(counter)
        row = public[i % len(public)].copy()
        row[0] += np.float32(i * 1e-3)  # distinct bytes, a plausible row
        return row[None, :]

    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        client.label(next_input())
        start, facts_before = client.budget(), secure_ledger_facts(serve.ledger)
        callers = Callers(serve, next_input, clients, pause=1.0)  # 4 calls/s: the owners admit 120 rounds
        time.sleep(3.0)  # rounds in flight: the stop lands in one or between two
        before = client.budget()
        victim = max(serve.teacher_pids())  # the last owner's actor
        health_seen, done = [], threading.Event()

        def watch_health() -> None:
            while not done.is_set():
                health_seen.append((time.monotonic() - stopped, health_status(serve)))
                done.wait(0.05)

        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        watcher = threading.Thread(target=watch_health, daemon=True)
        watcher.start()
        try:
            time.sleep(stop_for)
            during = client.budget()
        finally:
            os.kill(victim, signal.SIGCONT)
        serving_after = wait_for(lambda: health_status(serve) == SERVING, 60, 0.05)
        done.set()
        still_calling = callers.stop()
        after, facts_after = client.budget(), secure_ledger_facts(serve.ledger)
        try:
            client.label(next_input())
            fresh_after = "OK"
        except grpc.RpcError as err:
            fresh_after = err.code().name
    during_stop = [(at - stopped, took, code) for at, took, code in callers.calls
                   if stopped - DEADLINE <= at <= stopped + stop_for]
    calls_in_stop = Counter(code for _, _, code in during_stop)
    not_serving = next((at for at, status in health_seen if status == NOT_SERVING), None)
    rounds = facts_after["charges"] - facts_before["charges"]
    batches = facts_after["answer_batches"] - facts_before["answer_batches"]
    outcome.measured.update({
        "stopped_for_s": stop_for, "clients": clients, "client_deadline_s": DEADLINE,
        "calls_around_the_stop": dict(calls_in_stop),
        "slowest_call_around_the_stop_s": round(max((took for _, took, _ in during_stop), default=0.0), 2),
        **callers.summary(),
        "not_serving_after_stop_s": None if not_serving is None else round(not_serving, 2),
        "serving_after_sigcont_s": None if serving_after is None else round(serving_after, 2),
        "epsilon_spent": {"before": before["epsilon_spent"], "while_stopped": during["epsilon_spent"],
                          "after": after["epsilon_spent"]},
        "rounds_charged": rounds, "answered_batches_recorded": batches,
        "rounds_charged_with_no_answer": rounds - batches,
        "inputs_recorded_as_answered": after["queries_answered"] + after["queries_abstained"]
        - start["queries_answered"] - start["queries_abstained"],
        "inputs_clients_got_labels_for": callers.answered_inputs,  # each call: one fresh input
        "fresh_call_after_recovery": fresh_after,
    })
    m = outcome.measured
    codes = set(m["calls_by_status"])
    outcome.check(calls_in_stop.get("UNAVAILABLE", 0) > 0 and codes <= {"OK", "UNAVAILABLE"},
                  f"calls ended {m['calls_by_status']}: not only OK and UNAVAILABLE")
    outcome.check(m["slowest_call_s"] is not None and m["slowest_call_s"] < DEADLINE and not still_calling,
                  f"a call ran to the client's {DEADLINE:g} s deadline")
    outcome.check(not_serving is not None, "health never went NOT_SERVING while the owner was stopped")
    outcome.check(serving_after is not None and fresh_after == "OK", "not serving again after SIGCONT")
    outcome.check(m["inputs_recorded_as_answered"] == m["inputs_clients_got_labels_for"],
                  "inputs recorded as answered that no client got a label for, or the reverse")
    outcome.check(0 <= m["rounds_charged_with_no_answer"] <= 1,
                  f"{m['rounds_charged_with_no_answer']} rounds charged with no answer: at most the one in flight")
    outcome.check(during["epsilon_spent"] <= after["epsilon_spent"] and before["epsilon_spent"] <= during["epsilon_spent"],
                  "ε went down")


def secure_ledger_facts(path: Path) -> dict:
    """Charges (one per secure round) and recorded answer batches (one per answered batch)."""
    with sqlite3.connect(path) as db:
        return {"charges": db.execute("SELECT COUNT(*) FROM charges").fetchone()[0],
                "answer_batches": db.execute("SELECT COUNT(*) FROM answer_batches").fetchone()[0]}


def full_disk(outcome: Outcome, serve: Serve, folder: Path) -> None:
    """``serve`` with its ledger on a 2 MiB tmpfs mounted on ``folder`` in a mount namespace of its
    own, filled until ENOSPC: fresh inputs UNAVAILABLE with the disk named (before: INTERNAL),
    inputs on record still answered, nothing charged, a few log lines; space freed, fresh inputs
    answered."""
    disk = Path(f"/proc/{serve.process.pid}/root{folder}")  # serve's mounts (the wrapper execs serve)
    inputs = marked_inputs(3600, 60)
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        answered = labels_of(client, inputs[:8])
        written = 0
        with open(disk / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    written += filler.write(b"\0" * 65536)
            except OSError as err:
                full = err.errno == errno.ENOSPC
        before = client.budget()
        codes, messages = Counter(), Counter()
        for i in range(8, 48):
            try:
                client.label(inputs[i : i + 1])
                codes["OK"] += 1
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                messages[err.details()] += 1
        repeated = labels_of(client, inputs[:8])
        after = client.budget()
        health = health_status(serve)
        (disk / "filler").unlink()
        fresh = labels_of(client, inputs[48:56])
    log_lines = [line for line in serve.err_path.read_text().splitlines() if "cannot be written" in line]
    outcome.measured.update({
        "filler_bytes": written, "disk_full": full, "fresh_calls_by_status": dict(codes),
        "messages": dict(messages), "on_record_while_full": repeated if isinstance(repeated, str)
        else "same labels" if np.array_equal(repeated, answered) else "changed",
        "epsilon_spent": {"full_before": before["epsilon_spent"], "full_after": after["epsilon_spent"]},
        "health_while_full": {SERVING: "SERVING", NOT_SERVING: "NOT_SERVING"}.get(health, str(health)),
        "fresh_after_freeing": fresh if isinstance(fresh, str) else "OK", "server_log_lines": len(log_lines),
    })
    outcome.check(full and not isinstance(answered, str), "the disk did not fill, or the first inputs failed")
    outcome.check(codes.get("UNAVAILABLE", 0) >= 38 and set(codes) <= {"OK", "UNAVAILABLE"},
                  f"fresh calls on a full disk ended {dict(codes)}")
    outcome.check(all(message.startswith(STORAGE_FULL) for message in messages), f"messages {dict(messages)}")
    outcome.check(codes.get("OK", 0) > 0 or after["epsilon_spent"] == before["epsilon_spent"],
                  "refused calls were charged")
    outcome.check(outcome.measured["on_record_while_full"] == "same labels", "inputs on record were not answered")
    outcome.check(not isinstance(fresh, str), f"after freeing space: {fresh}")
    outcome.check(1 <= len(log_lines) <= 5, f"{len(log_lines)} log lines for the failed calls")


# ---- the service findings of issue 51, one scenario each ----

# The demo (public-cluster votes on digits) as shipped, with a declared budget that every call of
# the scenario fits in (one Gaussian release per call, ε ≈ 1 alone): each refusal there is a failure.
CLUSTER_CONFIG = {**yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text()), "name": "soak-clusters",
                  "privacy": {"budget": 20.0, "delta": 1.0e-5}}


def cluster_vote_serve(outcome: Outcome, serve: Serve, clients: int = 6, calls: int = 4, size: int = 8) -> None:
    """Public-cluster votes under ``clients`` concurrent clients, each asking ``calls`` calls of
    ``size`` new inputs of its own: every call answered or refused with a status; each answered
    call one charge paying for that call's inputs alone (never merged with another client's, whose
    inputs would then move its labels); each client's first call asked again: the record's labels,
    no charge; health SERVING; ε within the budget."""
    flat = marked_inputs(9000, clients * calls * size)
    inputs = flat.reshape(clients, calls, size, *flat.shape[1:])
    call_of = {key: (client, call) for client in range(clients) for call in range(calls)
               for key in input_keys(inputs[client, call])}
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        before, facts_before, last_charge = client.budget(), ledger_facts(serve.ledger), last_charge_id(serve.ledger)
    start, lock = threading.Barrier(clients), threading.Lock()
    spans: list[tuple[float, float]] = []
    codes, answers = Counter(), {}

    def ask(index: int) -> None:
        with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as own:
            start.wait()
            for call in range(calls):
                began = time.monotonic()
                try:
                    labels, code = own.label(inputs[index, call]), "OK"
                except grpc.RpcError as err:
                    labels, code = None, "RESOURCE_EXHAUSTED (budget)" if is_budget_refusal(err) else err.code().name
                with lock:
                    spans.append((began, time.monotonic()))
                    codes[code] += 1
                    if labels is not None:
                        answers[index, call] = labels

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=clients * calls * DEADLINE)
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        after_fresh, facts_fresh = client.budget(), ledger_facts(serve.ledger)
        releases = charged_calls(serve.ledger, last_charge, call_of)
        repeated = {index: labels_of(client, inputs[index, 0]) for index in range(clients) if (index, 0) in answers}
        after, facts_after = client.budget(), ledger_facts(serve.ledger)
    health = health_status(serve)
    same = [index for index, labels in repeated.items()
            if not isinstance(labels, str) and np.array_equal(labels, answers[index, 0])]
    outcome.measured.update({
        "config": "configs/demo.yaml (public-cluster votes, digits) with privacy.budget 20",
        "clients": clients, "calls_per_client": calls, "new_inputs_per_call": size,
        "calls_by_status": dict(codes), "calls_in_flight_at_once_max": max_overlap(spans),
        "call_latency_ms": ms([end - began for began, end in spans]),
        "charges_added": facts_fresh["charges"] - facts_before["charges"], "fresh_calls_answered": len(answers),
        "charges_paying_for_one_call_alone": releases["one_call"], "charges_paying_for_several_calls":
        releases["several_calls"], "answers_per_charge": releases["answers_per_charge"],
        "repeated_first_calls": {"asked": len(repeated), "same_labels": len(same),
                                 "charges_added": facts_after["charges"] - facts_fresh["charges"],
                                 "cache_hits_added": after["cache_hits"] - after_fresh["cache_hits"]},
        "health_after": {SERVING: "SERVING", NOT_SERVING: "NOT_SERVING"}.get(health, str(health)),
        "epsilon": {"before": before["epsilon_spent"], "spent": after["epsilon_spent"],
                    "limit": after["epsilon_limit"], "guarantee": after["guarantee"]["epsilon"]},
    })
    m = outcome.measured
    outcome.check(sum(codes.values()) == clients * calls and set(codes) <= {"OK", "UNAVAILABLE",
                  "RESOURCE_EXHAUSTED (budget)"}, f"calls ended {dict(codes)}")
    outcome.check(codes.get("OK", 0) == clients * calls, f"{codes.get('OK', 0)} of {clients * calls} calls "
                  "answered under a budget that pays for all")
    outcome.check(m["calls_in_flight_at_once_max"] > 1, "the calls never overlapped: nothing could be merged")
    outcome.check(m["charges_added"] == len(answers), f"{m['charges_added']} charges for {len(answers)} fresh calls")
    outcome.check(releases["several_calls"] == 0 and releases["one_call"] == len(answers)
                  and releases["answers_per_charge"] == [size], "a charge paid for inputs of several calls")
    outcome.check(len(same) == len(repeated) == clients, f"{len(same)} of {clients} repeated calls had the "
                  "record's labels")
    outcome.check(m["repeated_first_calls"]["charges_added"] == 0
                  and m["repeated_first_calls"]["cache_hits_added"] == clients * size,
                  "a repeated call was charged, or not answered from the record")
    outcome.check(health == SERVING, f"health {m['health_after']}, not SERVING")
    outcome.check(after["epsilon_spent"] <= after["epsilon_limit"] and after["guarantee"]["epsilon"] <=
                  after["epsilon_limit"], f"ε {after['epsilon_spent']} over the budget {after['epsilon_limit']}")


def last_charge_id(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COALESCE(MAX(id), 0) FROM charges").fetchone()[0]


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most calls in flight at one instant."""
    events = sorted([(began, 1) for began, _ in spans] + [(end, -1) for _, end in spans])  # an end first
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def charged_calls(path: Path, after_id: int, call_of: dict[bytes, tuple[int, int]]) -> dict:
    """For each charge after ``after_id``: whose calls (client, call) the answers it pays for came from."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT charge_id, key FROM answers WHERE charge_id > ?", (after_id,)).fetchall()
    calls: dict[int, set] = {}
    for charge_id, key in rows:
        calls.setdefault(charge_id, set()).add(call_of.get(key, "not the scenario's"))
    sizes = Counter(charge_id for charge_id, _ in rows)
    return {"one_call": sum(len(whose) == 1 for whose in calls.values()),
            "several_calls": sum(len(whose) > 1 for whose in calls.values()),
            "answers_per_charge": sorted(set(sizes.values()))}


def record_write_failure(outcome: Outcome, serve: Serve, home: Path, fresh: int = 5) -> None:
    """Issue 51's R22 sequence: the ledger's record outside its file made unwritable (a file where
    ``$CONCLAVE_HOME/ledgers`` should be); fresh calls refused ``UNAVAILABLE`` saying nothing was
    charged, and nothing is; inputs on record still answered; the folder mended: each fresh input
    asked again is charged once, and asked once more answered from the record, free, alike.
    Before: refused as uncharged while the ledger's charges went 5 → 10, then charged again."""
    from conclave.cluster.api import RECORD_UNWRITABLE

    folder = home / "ledgers"
    inputs = marked_inputs(10000, 8 + fresh)
    known, new = inputs[:8], inputs[8:]
    with AggregatorClient(serve.address, token=TOKEN, timeout=DEADLINE) as client:
        answered = [labels_of(client, known[i : i + 1]) for i in range(len(known))]  # one charge each
        if any(isinstance(labels, str) for labels in answered):
            outcome.problems.append(f"labelling before the failure failed: {answered}")
            return
        answered = np.concatenate(answered)
        before, facts_before = client.budget(), ledger_facts(serve.ledger)
        saved = {record.name: record.read_bytes() for record in folder.iterdir()}
        for record in folder.iterdir():  # as the probe did: the folder replaced by a file
            record.unlink()
        folder.rmdir()
        folder.write_text("not a folder\n")
        codes, messages = Counter(), Counter()
        for i in range(fresh):
            try:
                client.label(new[i : i + 1])
                codes["OK"] += 1
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                messages[err.details()] += 1
        on_record = labels_of(client, known)
        blocked, facts_blocked = client.budget(), ledger_facts(serve.ledger)
        health = health_status(serve)
        folder.unlink()  # the operator mends it
        folder.mkdir()
        for name, data in saved.items():
            (folder / name).write_bytes(data)
        mended = [labels_of(client, new[i : i + 1]) for i in range(fresh)]
        facts_mended = ledger_facts(serve.ledger)
        again = labels_of(client, new)
        after, facts_after = client.budget(), ledger_facts(serve.ledger)
    mended_ok = not any(isinstance(labels, str) for labels in mended)
    log_lines = [line for line in serve.err_path.read_text().splitlines() if "cannot be written" in line]
    outcome.measured.update({
        "config": "configs/digits-knn.yaml with privacy.budget 100", "conclave_home": "the bench's own",
        "records_in_the_folder": len(saved), "fresh_calls_while_unwritable": dict(codes), "messages": dict(messages),
        "charges": {"before": facts_before["charges"], "while_unwritable": facts_blocked["charges"],
                    "after_mending_and_asking_again": facts_mended["charges"],
                    "after_asking_once_more": facts_after["charges"]},
        "answers_on_record": {"before": facts_before["answers"], "while_unwritable": facts_blocked["answers"],
                              "after": facts_after["answers"]},
        "epsilon_spent": {"before": before["epsilon_spent"], "while_unwritable": blocked["epsilon_spent"],
                          "after": after["epsilon_spent"]},
        "on_record_while_unwritable": on_record if isinstance(on_record, str)
        else "same labels" if np.array_equal(on_record, answered) else "changed",
        "health_while_unwritable": {SERVING: "SERVING", NOT_SERVING: "NOT_SERVING"}.get(health, str(health)),
        "fresh_after_mending": "OK" if mended_ok else [m for m in mended if isinstance(m, str)][0],
        "asked_once_more": again if isinstance(again, str)
        else "same labels" if mended_ok and np.array_equal(again, np.concatenate(mended)) else "changed",
        "server_log_lines": len(log_lines), "staged_records_left": len(list(folder.glob("*.tmp"))),
    })
    m = outcome.measured
    outcome.check(len(saved) >= 1, "no record in the folder: the scenario proves nothing")
    outcome.check(codes == {"UNAVAILABLE": fresh}, f"fresh calls while unwritable ended {dict(codes)}")
    outcome.check(set(messages) == {RECORD_UNWRITABLE}, f"messages {dict(messages)}")
    outcome.check(facts_blocked["charges"] == facts_before["charges"] and facts_blocked["answers"] ==
                  facts_before["answers"] and blocked["epsilon_spent"] == before["epsilon_spent"],
                  f"refused calls were charged: {m['charges']}")
    outcome.check(m["on_record_while_unwritable"] == "same labels", "inputs on record were not answered alike")
    outcome.check(mended_ok and facts_mended["charges"] == facts_before["charges"] + fresh,
                  f"after mending: {m['fresh_after_mending']}, charges {m['charges']} (expected one per fresh "
                  "input)")
    outcome.check(m["asked_once_more"] == "same labels" and facts_after["charges"] == facts_mended["charges"],
                  f"asked once more: {m['asked_once_more']}, charges {m['charges']}")
    outcome.check(1 <= len(log_lines) <= fresh, f"{len(log_lines)} log lines for the failed calls")
    outcome.check(not m["staged_records_left"], f"{m['staged_records_left']} staged records left in the folder")


def disk_wrapper(folder: Path, size: str) -> tuple[str, ...] | None:
    """A command that mounts a tmpfs of ``size`` on ``folder`` in a private mount namespace and
    execs the rest; None where this machine cannot (``unshare`` missing or not permitted)."""
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    wrapper = ("unshare", *flags, "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs -o size={size} conclave-soak {folder} && exec "$0" "$@"')
    if shutil.which("unshare") is None or subprocess.run([*wrapper, "true"], capture_output=True).returncode:
        return None
    return wrapper


ISSUE_28 = ("health_watch_flood", "hung_teacher", "fourth_kill", "bad_tls_files", "sigkill_leftovers",
            "partial_batch_at_the_end_of_the_budget")
ISSUE_36 = ("signed_zero_reask", "knn_actor_kill", "stopped_secure_owner", "full_disk")
ISSUE_51 = ("cluster_vote_serve", "record_write_failure")
ALL_SCENARIOS = ISSUE_28 + ISSUE_36 + ISSUE_51


def scenarios(workdir: Path, only: set[str] | None = None) -> dict[str, dict]:
    """Each failure of issues 28, 36 and 51 against real ``conclave serve`` processes (``only``:
    those named); ``passed`` and why. A serve starts only for the scenarios that run on it."""
    results: dict[str, Outcome] = {}
    wanted = set(ALL_SCENARIOS) if only is None else only
    scenario_config, partial_config = workdir / "scenarios.yaml", workdir / "partial.yaml"
    scenario_config.write_text(yaml.safe_dump(SCENARIO_CONFIG))
    partial_config.write_text(yaml.safe_dump(PARTIAL_CONFIG))

    def on_serve(serve: Serve, runs: list[tuple[str, str, tuple]]) -> None:
        """Start ``serve`` and run each (key, title, extra arguments) that is wanted on it."""
        runs = [run for run in runs if run[0] in wanted]
        if not runs:
            return
        try:
            serve.start()
            for key, title, extra in runs:
                results[key] = scenario(title, SCENARIOS[key], serve, *extra)
        except RuntimeError as err:  # serve did not come up: the scenarios on it fail with that reason
            results.update({key: Outcome(problems=[str(err)]) for key, _, _ in runs if key not in results})
        finally:
            if serve.process is not None and serve.process.poll() is None:
                serve.stop()

    on_serve(Serve(scenario_config, workdir / "scenarios-ledger.sqlite", free_port(), workdir, name="scenarios"),
             [("health_watch_flood", "health Watch flood", ()), ("hung_teacher", "hung teacher", ()),
              ("fourth_kill", "fourth kill", ()), ("signed_zero_reask", "signed-zero re-ask", ())])
    if "bad_tls_files" in wanted:
        results["bad_tls_files"] = scenario("bad TLS files", bad_tls, workdir)

    if wanted & {"sigkill_leftovers", "partial_batch_at_the_end_of_the_budget"}:
        temp = workdir / "t"  # short: Ray's socket paths under it must stay below 108 bytes
        base = temp / f"conclave-private-{os.getuid()}"
        serve = Serve(partial_config, workdir / "partial-ledger.sqlite", free_port(), workdir, name="partial",
                      env={"TMPDIR": str(temp)})
        decoys = plant_decoys(base)
        try:
            serve.start()
            # The partial batch runs on this serve's first start; the leftovers scenario then kills it.
            partial = scenario("partial batch at the end of the budget", partial_batch, serve)
            results["sigkill_leftovers"] = scenario("SIGKILL leftovers", sigkill_leftovers, serve, base, decoys)
            results["partial_batch_at_the_end_of_the_budget"] = partial
        except RuntimeError as err:
            results.update({name: Outcome(problems=[str(err)])
                            for name in ("sigkill_leftovers", "partial_batch_at_the_end_of_the_budget")})
        finally:
            if serve.process is not None and serve.process.poll() is None:
                serve.stop()
            for name in decoys:
                shutil.rmtree(base / name, ignore_errors=True)

    knn_config, secure_config = workdir / "knn.yaml", workdir / "secure.yaml"
    knn_config.write_text(yaml.safe_dump(KNN_CONFIG))
    secure_config.write_text(yaml.safe_dump(SECURE_CONFIG))
    on_serve(Serve(knn_config, workdir / "knn-ledger.sqlite", free_port(), workdir, name="knn"),
             [("knn_actor_kill", "kNN actor kill", ())])
    home = workdir / "home"  # the owners' lifetime ledgers: the bench's, never the user's
    home.mkdir(exist_ok=True)
    on_serve(Serve(secure_config, workdir / "secure-ledger.sqlite", free_port(), workdir, name="secure",
                   env={"CONCLAVE_HOME": str(home)}),
             [("stopped_secure_owner", "stopped secure owner", ())])
    if "full_disk" in wanted:
        disk = workdir / "disk"
        disk.mkdir(exist_ok=True)
        wrapper = disk_wrapper(disk, "2m")
        if wrapper is None:
            results["full_disk"] = Outcome(measured={"skipped": "no private tmpfs here (unshare missing or refused)"})
        else:
            on_serve(Serve(scenario_config, disk / "ledger.sqlite", free_port(), workdir, name="full-disk",
                           wrapper=wrapper), [("full_disk", "full disk", (disk,))])

    cluster_config = workdir / "clusters.yaml"
    cluster_config.write_text(yaml.safe_dump(CLUSTER_CONFIG))
    on_serve(Serve(cluster_config, workdir / "clusters-ledger.sqlite", free_port(), workdir, name="clusters",
                   env={"CONCLAVE_HOME": str(home)}), [("cluster_vote_serve", "cluster-vote serve", ())])
    record_home = workdir / "record-home"  # its ledgers/ folder is the one the scenario breaks
    on_serve(Serve(knn_config, workdir / "record-ledger.sqlite", free_port(), workdir, name="record",
                   env={"CONCLAVE_HOME": str(record_home)}),
             [("record_write_failure", "record-write failure", (record_home,))])
    return {name: outcome.as_dict() for name, outcome in results.items()}


SCENARIOS = {"health_watch_flood": watch_flood, "hung_teacher": hung_teacher, "fourth_kill": fourth_kill,
             "signed_zero_reask": signed_zero_reask, "knn_actor_kill": knn_actor_kill,
             "stopped_secure_owner": stopped_secure_owner, "full_disk": full_disk,
             "cluster_vote_serve": cluster_vote_serve, "record_write_failure": record_write_failure}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 clients × 100 calls, one kill")
    parser.add_argument("--out", type=Path, default=None,
                        help="default results/bench/service_soak.json, or service_soak_scenarios.json with --only")
    parser.add_argument("--only", default=None, metavar="NAME[,NAME]",
                        help=f"run only these scenarios, without the load: {', '.join(ALL_SCENARIOS)}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.only is not None:
        return only_scenarios(set(args.only.split(",")), args.out or ROOT / "results" / "bench" /
                              "service_soak_scenarios.json")
    args.out = args.out or ROOT / "results" / "bench" / "service_soak.json"
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
    from conclave.cluster.api import reclaim_orphaned_ray

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
    out["scenarios"] = scenarios(workdir)
    failed = [name for name, result in out["scenarios"].items() if not result["passed"]]
    out["seconds_with_scenarios"] = time.monotonic() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"service soak: {out['label_calls']['total']} Label calls {dict(tally.codes)}; {len(tally.answers)} distinct "
          f"answered, {facts['charges']} charges; changed answers {tally.changed}; ε max {probe.max_epsilon:.3f} "
          f"of {final['epsilon_limit']:.3g}; p50/p99 {out['latency_ms_answered']['p50']:.1f}/"
          f"{out['latency_ms_answered']['p99']:.1f} ms; malformed {dict(malformed)}; {len(restarts)} restarts; "
          f"ledger {facts['integrity_check']}")
    for name, result in out["scenarios"].items():
        print(f"scenario {name}: {'passed' if result['passed'] else 'FAILED'} ({result['reason']}; "
              f"{result['seconds']} s)")
    return 1 if failed else 0


def only_scenarios(names: set[str], out: Path) -> int:
    """The named scenarios alone (no load), written to ``out``; 1 if one failed."""
    unknown = names - set(ALL_SCENARIOS)
    if unknown:
        print(f"unknown scenarios {sorted(unknown)}: choose from {', '.join(ALL_SCENARIOS)}", file=sys.stderr)
        return 2
    began = time.monotonic()
    results = scenarios(Path(tempfile.mkdtemp(prefix="soak-")), names)
    # serve draws its noise from OS entropy, and these configs declare their budgets
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "service_soak_scenarios", **soundness([]),
                               "thread_settings": thread_settings(), "scenarios": results,
                               "seconds": time.monotonic() - began}, indent=2) + "\n")
    for name, result in results.items():
        print(f"scenario {name}: {'passed' if result['passed'] else 'FAILED'} ({result['reason']}; "
              f"{result['seconds'] if 'seconds' in result else '-'} s)")
    return 1 if any(not result["passed"] for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
