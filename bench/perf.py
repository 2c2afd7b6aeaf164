"""Benchmark: speed against this machine's own limits, as ratios measured in one run.

Every comparison runs its variants alternately inside each repetition (the machine is
shared, absolute times drift) and reports min and median. Writes results/bench/perf.json:

  threads                torch training at 2 threads against 1, in one process
  teacher_inference      250 tutorial-CNN teachers voting on 256 MNIST images: stacked into one
                         network (learning.models.ensemble, what the teacher actors run) against
                         the models one by one, with index-free and with torch's pooling (votes
                         must be identical), and the stacked path's FLOP rate as a fraction of
                         a large matmul's (``flop_fraction``)
  dpsgd.<model>          a DP-SGD step against a plain SGD step, batch 256, for each way
                         Opacus clips per example (hooks, expanded weights, ghost clipping)
                         and for book-keeping (learning.bookkeeping, where it applies);
                         ``step_ratio`` is the fastest's, ``auto_mode`` what train_dp's
                         "auto" picks
  allocator              book-keeping's step ratio (ScatterNet, ResNet) with glibc's allocator
                         defaults against learning.allocator's, one fresh process each per
                         repetition (``bk_speedup``)
  aggregator             single-input Label calls through gRPC on 127.0.0.1 against the same
                         call in-process, with a declared budget, the ledger's charge alone,
                         and a bare thread hand-off timed beside each call (``p99_ms``)
  teacher_pool           training teachers on a Ray pool of 2 one-CPU actors against one
                         process at its best thread count (``speedup``)
  end_to_end             what a user waits for: Label calls from outside against a real
                         ``conclave serve`` process with its teacher actors (the digits'
                         50 teachers, digits-teachers.yaml; MNIST's 250 without --quick): a fresh single input, a
                         repeated one and a bare gRPC health check in turn; one input through
                         one actor's stacked teachers alone; 16 concurrent clients (calls per
                         ledger transaction: concurrent calls answered together); batches of 1,024
  gpu                    whether a GPU was available for these figures

No ε of any data is published: the aggregator answers fixed votes against a declared budget,
its noise from OS entropy (``SECURE``, whose soundness the file's ``sound`` reports).

    python bench/perf.py            # the whole set (about 12 to 16 minutes on 2 cores)
    python bench/perf.py --quick    # fewer repetitions and smaller sizes
    python bench/perf.py --only end_to_end aggregator   # re-run these, keep the other sections' figures

``section_builds`` says which commit each section's figures were measured on.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conclave.learning.threads import share_cores, thread_settings  # noqa: E402

share_cores()  # before torch loads

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from conclave.learning.grad_sample_modes import PROBED as DPSGD_MODES  # noqa: E402  Opacus's ways to clip per example
from conclave.privacy.noise import SECURE  # noqa: E402

from bench.soundness import soundness, timed_on  # noqa: E402

log = logging.getLogger("bench.perf")


def interleaved(variants: dict[str, Callable[[], object]], repetitions: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, the variants alternating within every repetition."""
    for run in variants.values():  # warm-up: allocators, kernels, lazy imports
        run()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repetitions):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values)}


def ratios(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """min and median of per-repetition ratios (each pair measured back to back)."""
    return spread([a / b for a, b in zip(numerator, denominator)])


def flops_per_example(model: nn.Module, example: torch.Tensor) -> int:
    """2 × multiply-adds of every Conv2d and Linear for one example (the rest is negligible)."""
    total = 0

    def count(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            total += 2 * output[0].numel() * per_output
        elif isinstance(module, nn.Linear):
            total += 2 * module.in_features * module.out_features

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(example[None])
    for hook in hooks:
        hook.remove()
    return total


def matmul_gflops(size: int = 1024, times: int = 8) -> Callable[[], float]:
    a, b = torch.rand(size, size), torch.rand(size, size)
    return lambda: [a @ b for _ in range(times)]


def mnist_or_random(count: int) -> np.ndarray:
    root = ROOT.parent / "shared" / "data" / "mnist"
    if root.is_dir():
        from conclave.learning.data import load_mnist

        return load_mnist(str(root))[1].x[:count]
    return np.random.default_rng(0).random((count, 1, 28, 28), dtype=np.float32)


def bench_threads(repetitions: int, quick: bool) -> dict:
    from conclave.learning.models import build_model

    x = torch.rand(512 if quick else 2048, 1, 28, 28)
    y = torch.randint(0, 10, (len(x),))

    def train(threads: int) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(threads)
            model = build_model("tutorial_cnn", 10, seed=0)
            optimizer = torch.optim.Adam(model.parameters(), 1e-3)
            for start in range(0, len(x), 64):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x[start:start + 64]), y[start:start + 64]).backward()
                optimizer.step()
        return run

    seconds = interleaved({"1": train(1), "2": train(2)}, repetitions)
    torch.set_num_threads(1)
    return {"work": f"tutorial_cnn, one epoch over {len(x)} examples, batch 64",
            "seconds_by_threads": {k: spread(v) for k, v in seconds.items()},
            "two_over_one": ratios(seconds["2"], seconds["1"])}


def bench_teacher_inference(repetitions: int, quick: bool) -> dict:
    from conclave.learning.models import build_model
    from conclave.learning.models.ensemble import StackedEnsemble
    from conclave.learning.models.pooling import MaxPool2d
    from conclave.learning.training import predict

    teachers = 25 if quick else 250
    images = mnist_or_random(256)
    models = [build_model("tutorial_cnn", 10, seed=i).eval() for i in range(teachers)]
    torch_pooled = copy.deepcopy(models)
    for model in torch_pooled:
        for parent in model.modules():
            for name, child in parent.named_children():
                if isinstance(child, MaxPool2d):
                    setattr(parent, name, nn.MaxPool2d(child.kernel_size, child.stride))
    stacked = StackedEnsemble.of(models)

    def histogram(predicted: np.ndarray) -> np.ndarray:
        counts = np.zeros((len(images), 10), dtype=np.int64)
        for row in predicted:
            counts[np.arange(len(images)), row] += 1
        return counts

    def one_by_one(ensemble: list[nn.Module]) -> Callable[[], np.ndarray]:
        return lambda: histogram(np.stack([predict(model, images) for model in ensemble]))

    variants = {"stacked": lambda: histogram(stacked.predict(images)),  # what TeacherGroup.votes does
                "one_by_one": one_by_one(models), "torch_pool": one_by_one(torch_pooled)}
    reference = variants["torch_pool"]()
    identical = all(np.array_equal(run(), reference) for run in variants.values())
    seconds = interleaved({**variants, "matmul": matmul_gflops()}, repetitions)
    flops = flops_per_example(models[0], torch.from_numpy(images[0])) * teachers * len(images)
    matmul_flops = 8 * 2 * 1024 ** 3
    achieved = [flops / s / 1e9 for s in seconds["stacked"]]
    peak = [matmul_flops / s / 1e9 for s in seconds["matmul"]]
    return {
        "teachers": teachers, "images": len(images), "flops_per_image_per_teacher": flops // (teachers * len(images)),
        "identical_votes": identical,
        "labels_per_second": spread([len(images) / s for s in seconds["stacked"]]),
        "labels_per_second_one_by_one": spread([len(images) / s for s in seconds["one_by_one"]]),
        "labels_per_second_torch_pool": spread([len(images) / s for s in seconds["torch_pool"]]),
        "speedup_over_one_by_one": ratios(seconds["one_by_one"], seconds["stacked"]),
        "speedup_over_torch_pool": ratios(seconds["torch_pool"], seconds["stacked"]),
        "gflops": spread(achieved), "matmul_gflops": spread(peak),
        "flop_fraction": spread([a / p for a, p in zip(achieved, peak)]),
    }


DPSGD_MODELS = {  # name: (in_channels, input side, kwargs), as the configs use them
    "tutorial_cnn": (1, 28, {}), "tutorial_cnn_tanh": (1, 28, {}), "scatternet_cnn": (81, 7, {}),
    "digits_cnn": (1, 8, {}), "gn_cnn": (3, 32, {}), "gn_resnet18": (3, 32, {"width": 0.25}),
}


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One non-private SGD step of ``model`` on the batch (x, y): what a DP-SGD step is against."""
    optimizer = torch.optim.SGD(model.parameters(), 0.01)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def bench_dpsgd(repetitions: int, quick: bool) -> dict:
    import warnings

    from conclave.learning.grad_sample_modes import fastest_mode, private_step
    from conclave.learning.models import build_model

    warnings.filterwarnings("ignore", module="opacus")
    warnings.filterwarnings("ignore", message="Full backward hook")
    batch = 64 if quick else 256
    out = {}
    for name, (channels, side, kwargs) in DPSGD_MODELS.items():
        if quick and name == "gn_resnet18":
            continue
        x, y = torch.rand(batch, channels, side, side), torch.randint(0, 10, (batch,))

        def private(mode: str) -> Callable[[], None] | None:
            try:
                return private_step(build_model(name, 10, channels, seed=0, input_size=side, **kwargs), x, y, mode)
            except ValueError:  # book-keeping refuses models with layers it cannot clip
                return None

        steps = {mode: step for mode in DPSGD_MODES if (step := private(mode)) is not None}
        seconds = interleaved({"plain": plain_step(build_model(name, 10, channels, seed=0, input_size=side, **kwargs),
                                                   x, y), **steps}, repetitions)
        by_mode = {mode: ratios(seconds[mode], seconds["plain"]) for mode in steps}
        fastest = min(by_mode, key=lambda mode: by_mode[mode]["median"])
        # What train_dp's "auto" picks for this model at this batch (its probe: 2 steps each).
        auto = fastest_mode(build_model(name, 10, channels, seed=0, input_size=side, **kwargs), (channels, side, side),
                            batch, DPSGD_MODES)
        out[name] = {"batch": batch, "plain_step_seconds": spread(seconds["plain"]), "fastest_mode": fastest,
                     "auto_mode": auto, "step_ratio": by_mode[fastest], "step_ratio_by_mode": by_mode}
        log.info("dpsgd %s: %s", name, ", ".join(f"{m} {r['median']:.2f}×" for m, r in by_mode.items()))
    return out


ALLOCATOR_SETTINGS = {  # process environments: glibc's defaults (our opt-out), or ours
    "glibc_defaults": {"CONCLAVE_KEEP_FREED_MEMORY": "0"}, "keep_freed_memory": {},
}


def bench_allocator(repetitions: int, quick: bool) -> dict:
    """Book-keeping and plain steps with glibc's allocator defaults against
    ``learning.allocator``'s settings. The settings hold for a whole process, so every
    repetition runs one fresh process of each, back to back (``--steps-child``)."""
    models = ["scatternet_cnn"] if quick else ["scatternet_cnn", "gn_resnet18"]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "CONCLAVE_KEEP_FREED_MEMORY")}
    runs: dict[str, list[dict]] = {setting: [] for setting in ALLOCATOR_SETTINGS}
    for _ in range(repetitions):
        for setting, environment in ALLOCATOR_SETTINGS.items():
            child = subprocess.run([sys.executable, __file__, "--steps-child", *models], env={**clean, **environment},
                                   capture_output=True, text=True, check=True, timeout=600)
            runs[setting].append(json.loads(child.stdout.splitlines()[-1]))
    out = {}
    for model in models:
        def seconds(setting: str, step: str) -> list[float]:
            return [run[model][step] for run in runs[setting]]
        out[model] = {
            "step_ratio": {setting: ratios(seconds(setting, "bk"), seconds(setting, "plain")) for setting in runs},
            "plain_step_seconds": {setting: spread(seconds(setting, "plain")) for setting in runs},
            "bk_speedup": ratios(seconds("glibc_defaults", "bk"), seconds("keep_freed_memory", "bk"))}
        log.info("allocator %s: bk step %.2f× plain with glibc's defaults, %.2f× keeping freed memory", model,
                 out[model]["step_ratio"]["glibc_defaults"]["median"],
                 out[model]["step_ratio"]["keep_freed_memory"]["median"])
    return {"batch": 256, "settings": ALLOCATOR_SETTINGS, **out}


def steps_child(models: list[str]) -> None:
    """In a fresh process: median seconds of a plain and a book-keeping step (batch 256, 3
    interleaved repetitions after a warm-up), printed as one JSON line."""
    from conclave.learning.grad_sample_modes import private_step
    from conclave.learning.models import build_model

    out = {}
    for name in models:
        channels, side, kwargs = DPSGD_MODELS[name]
        x, y = torch.rand(256, channels, side, side), torch.randint(0, 10, (256,))

        def model() -> nn.Module:
            return build_model(name, 10, channels, seed=0, input_size=side, **kwargs)
        seconds = interleaved({"plain": plain_step(model(), x, y), "bk": private_step(model(), x, y, "bk")}, 3)
        out[name] = {step: statistics.median(values) for step, values in seconds.items()}
    print(json.dumps(out))


class FixedVotes:
    """A vote source that answers at once, so the figures are the aggregator's own cost."""

    neighbouring = "add-remove"
    neighbouring_lemma = "benchmark: no data"
    votes_per_query, batch_coupled = 250, False
    local, num_classes = False, 10
    sample_rate = votes_per_record = None

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        histogram = np.zeros((len(inputs), 10), dtype=np.int64)
        histogram[:, 3], histogram[:, 5] = 200, 50
        return histogram

    def ready(self, timeout: float = 2.0) -> bool:
        return True


def bench_aggregator(calls: int) -> dict:
    from conclave.cluster.api import AggregatorClient, AggregatorServer, ServerSettings
    from conclave.privacy.accounting.filter import RenyiFilter
    from conclave.privacy.accounting.ledger import PrivacyLedger
    from conclave.privacy.mechanisms import build_mechanism

    rng = np.random.default_rng(0)
    inputs = rng.random((2 * calls + 20, 1, 8, 8), dtype=np.float32)  # distinct: every call is charged
    # A declared budget, as a service runs with, so every charge passes the filter's check;
    # large enough that the benchmark never spends it.
    budget = RenyiFilter(epsilon=1e4, delta=1e-5, order=32.0)
    # The machine's own share of the tail: one hand-off to a thread and back, timed beside
    # each call (a label call makes a few); on a busy shared machine its p99 rises with ours.
    handoff = futures.ThreadPoolExecutor(1)
    with tempfile.TemporaryDirectory() as folder:
        mechanism = build_mechanism("gnmax", sigma=40.0)
        ledger = PrivacyLedger(Path(folder) / "ledger.sqlite", 1e-5, budget)
        server = AggregatorServer(FixedVotes(), mechanism, ledger, (1, 8, 8), ServerSettings(), noise=SECURE)
        address = server.start()
        client = AggregatorClient(address)
        cursor = iter(range(len(inputs)))
        grpc_ms, local_ms, handoff_ms = [], [], []
        try:
            for i in range(calls + 10):
                started = time.perf_counter()
                client.label(inputs[next(cursor)][None])
                middle = time.perf_counter()
                server.label(inputs[next(cursor)][None])
                done = time.perf_counter()
                handoff.submit(int).result()
                if i >= 10:  # warm-up
                    grpc_ms.append(1e3 * (middle - started))
                    local_ms.append(1e3 * (done - middle))
                    handoff_ms.append(1e3 * (time.perf_counter() - done))
        finally:
            client.close()
            server.stop()
            handoff.shutdown()
        charge = mechanism.run_charge(1, 1).for_records("add-remove", "benchmark")
        charge_ms = []
        for i in range(calls):
            started = time.perf_counter()
            ledger.charge(charge, answers={i.to_bytes(8, "little") + b"bench": 1})
            charge_ms.append(1e3 * (time.perf_counter() - started))
        ledger.close()

    return {"calls": calls, "budget_epsilon": budget.epsilon, "single_input_grpc_ms": percentiles(grpc_ms),
            "single_input_in_process_ms": percentiles(local_ms), "p99_ms": percentiles(grpc_ms)["p99"],
            "ledger_charge_ms": percentiles(charge_ms), "thread_handoff_ms": percentiles(handoff_ms)}


def percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def marked(images: np.ndarray, count: int) -> np.ndarray:
    """``count`` distinct inputs from ``images``: copies told apart by one pixel's value."""
    rows = images[np.arange(count) % len(images)].copy()
    rows.reshape(count, -1)[:, 0] = (np.arange(count) // len(images) + 1) / (count // len(images) + 2)
    return rows.astype(np.float32)


def end_to_end_configs(quick: bool) -> dict[str, tuple[dict, np.ndarray]]:
    """The ensembles measured through ``serve``: the digits' 50 teachers (digits-teachers.yaml as
    shipped) and MNIST's 250 tutorial CNNs (mnist-gnmax.yaml, trained one epoch: inference
    time does not depend on how well they learned). A declared budget no run here can spend."""
    import yaml

    from conclave.learning.data import load_digits

    digits = yaml.safe_load((ROOT / "configs" / "digits-teachers.yaml").read_text())
    mnist = yaml.safe_load((ROOT / "configs" / "mnist-gnmax.yaml").read_text())
    mnist["teachers"]["train"]["epochs"] = 1
    configs = {"digits_50_teachers": (digits, load_digits()[1].x)}
    if not quick:
        configs["mnist_250_teachers"] = (mnist, mnist_or_random(1000))
    for config, _ in configs.values():
        config["privacy"] = {"budget": 1.0e5, "delta": 1.0e-5}
        config.pop("estimates", None)
    return configs


def inference_alone(config: dict, images: np.ndarray, actors: int, repetitions: int) -> dict[str, float]:
    """One input through the stacked ensemble one teacher actor holds (its share of the
    teachers, fresh models of the same architecture): the floor under a single call."""
    from conclave.learning.models import build_model, default_model
    from conclave.learning.models.ensemble import StackedEnsemble

    teachers = config["teachers"]["count"] // actors
    name = config["teachers"].get("model") or default_model(images.shape[1:], "image")
    ensemble = StackedEnsemble.of([build_model(name, 10, input_shape=images.shape[1:], seed=i).eval()
                                   for i in range(teachers)])
    seconds = interleaved({"one": lambda: ensemble.predict(images[:1])}, repetitions)["one"]
    return {"teachers_per_actor": teachers, **{k: 1e3 * v for k, v in percentiles(seconds).items()}}


def bench_end_to_end(calls: int, quick: bool) -> dict:
    """Label calls from outside, against a real ``conclave serve`` process with its teachers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from bench.serve_process import ServeProcess
    from conclave.cluster.api import AggregatorClient
    from conclave.privacy.accounting.ledger import read_history

    results: dict = {}
    for name, (config, images) in end_to_end_configs(quick).items():
        concurrent_calls, clients = (400 if quick else 2000), 16
        fresh = marked(images, 50 + calls + 20 + concurrent_calls + 3 * 1024)
        cursor = iter(range(len(fresh)))
        with tempfile.TemporaryDirectory() as folder, ServeProcess(config, Path(folder)) as serve:
            client = AggregatorClient(serve.address, token=serve.token, timeout=60)
            channel = grpc.insecure_channel(serve.address)
            health = health_pb2_grpc.HealthStub(channel)
            seen = [fresh[next(cursor)][None] for _ in range(50)]
            for one in seen:
                client.label(one)
            fresh_ms, repeat_ms, bare_ms = [], [], []
            for i in range(calls + 20):  # fresh, repeated and a bare gRPC call in turn
                one = fresh[next(cursor)][None]
                started = time.perf_counter()
                client.label(one)
                middle = time.perf_counter()
                client.label(seen[i % len(seen)])
                after = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                done = time.perf_counter()
                if i >= 20:
                    fresh_ms.append(1e3 * (middle - started))
                    repeat_ms.append(1e3 * (after - middle))
                    bare_ms.append(1e3 * (done - after))
            charges_before = len(read_history(serve.ledger))
            block = [fresh[next(cursor)][None] for _ in range(concurrent_calls)]
            latencies: list[float] = []

            def ask(one: np.ndarray) -> None:
                started = time.perf_counter()
                client.label(one)
                latencies.append(1e3 * (time.perf_counter() - started))

            started = time.perf_counter()
            with futures.ThreadPoolExecutor(clients) as pool:
                list(pool.map(ask, block))
            concurrent_seconds = time.perf_counter() - started
            groups = len(read_history(serve.ledger)) - charges_before
            batch_seconds = []
            for _ in range(3):
                batch = np.stack([fresh[next(cursor)] for _ in range(1024)])
                started = time.perf_counter()
                client.label(batch)
                batch_seconds.append(time.perf_counter() - started)
            client.close()
            channel.close()
            start_seconds = serve.start_seconds
        actors = 2  # one per CPU: the configs leave teachers.per_actor to the default
        results[name] = {
            "teachers": config["teachers"]["count"], "teacher_actors": actors,
            "mechanism": config["mechanism"]["name"], "serve_start_seconds": start_seconds,
            "single_fresh_ms": percentiles(fresh_ms), "single_repeated_ms": percentiles(repeat_ms),
            "bare_grpc_health_check_ms": percentiles(bare_ms),
            "inference_alone_ms": inference_alone(config, images, actors, 50 if quick else 200),
            "concurrent": {"clients": clients, "calls": concurrent_calls,
                           "labels_per_second": concurrent_calls / concurrent_seconds,
                           "latency_ms": percentiles(latencies),
                           "ledger_transactions": groups, "calls_per_transaction": concurrent_calls / max(groups, 1)},
            "batch_1024_labels_per_second": spread([1024 / s for s in batch_seconds]),
        }
    return results


def bench_teacher_pool(repetitions: int, quick: bool) -> dict:
    from conclave.cluster.api import TeacherGroup, TeacherPool, TeacherSource, start_ray
    from conclave.learning.train_config import TrainConfig

    import ray

    teachers = 4 if quick else 8
    mnist = ROOT.parent / "shared" / "data" / "mnist"
    if mnist.is_dir() and not quick:  # enough work per teacher that a process's first-use costs are small
        source = TeacherSource("mnist", str(mnist), public_size=1000, num_teachers=teachers)
        model, train = "tutorial_cnn", TrainConfig(epochs=2, batch_size=64, lr=1e-3)
    else:
        source = TeacherSource("digits", None, public_size=300, num_teachers=teachers)
        model, train = "digits_cnn", TrainConfig(epochs=5, batch_size=32, lr=3e-3)
    start_ray(num_cpus=2)

    def pool() -> tuple[Callable[[], None], Callable[[], None]]:
        teacher_pool = TeacherPool.of_source(source, teachers, model, train, num_actors=2)
        return (lambda: teacher_pool.train(progress=False)), teacher_pool.shutdown

    def one_process(threads: int) -> Callable[[], tuple[Callable[[], None], Callable[[], None]]]:
        def make() -> tuple[Callable[[], None], Callable[[], None]]:
            group = TeacherGroup(source, 0, teachers, model, train, num_threads=threads)
            return group.train_all, (lambda: None)
        return make

    # Each variant is set up (actors started, shards loaded) outside the timing, then trains.
    variants = {"pool": pool, "one_process_1_thread": one_process(1), "one_process_2_threads": one_process(2)}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    setup: dict[str, list[float]] = {name: [] for name in variants}
    for repetition in range(repetitions + 1):  # the first is a warm-up
        for name, make in variants.items():
            started = time.perf_counter()
            train_all, release = make()
            ready = time.perf_counter()
            train_all()
            done = time.perf_counter()
            release()
            if repetition:
                setup[name].append(ready - started)
                seconds[name].append(done - ready)
    torch.set_num_threads(1)
    ray.shutdown()
    best_one = [min(a, b) for a, b in zip(seconds["one_process_1_thread"], seconds["one_process_2_threads"])]
    return {"teachers": teachers, "actors": 2, "cpus": 2, "model": model, "epochs": train.epochs,
            "train_seconds": {name: spread(v) for name, v in seconds.items()},
            "setup_seconds": {name: spread(v) for name, v in setup.items()},
            "speedup": ratios(best_one, seconds["pool"]),
            "speedup_including_setup": ratios([b + min(s1, s2) for b, s1, s2 in zip(best_one, setup["one_process_1_thread"],
                                                                                    setup["one_process_2_threads"])],
                                              [a + b for a, b in zip(seconds["pool"], setup["pool"])])}


def _build() -> str:
    """The commit measured (with "+changes" when the working tree differs from it)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sizes")
    parser.add_argument("--only", nargs="*", default=None, help="run only these sections")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "perf.json")
    parser.add_argument("--steps-child", nargs="+", metavar="MODEL", help=argparse.SUPPRESS)  # bench_allocator's
    args = parser.parse_args()
    if args.steps_child:
        steps_child(args.steps_child)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    repetitions = 2 if args.quick else 5
    sections: dict[str, Callable[[], dict]] = {
        "threads": lambda: bench_threads(repetitions, args.quick),
        "teacher_inference": lambda: bench_teacher_inference(repetitions, args.quick),
        "dpsgd": lambda: bench_dpsgd(repetitions, args.quick),
        "allocator": lambda: bench_allocator(2 if args.quick else repetitions, args.quick),
        "aggregator": lambda: bench_aggregator(200 if args.quick else 2000),
        "teacher_pool": lambda: bench_teacher_pool(1 if args.quick else 3, args.quick),
        "end_to_end": lambda: bench_end_to_end(100 if args.quick else 500, args.quick),
    }
    results: dict = {"benchmark": "perf", **soundness([SECURE.unsound_reason]),
                     **timed_on("scikit-learn's digits, MNIST and random tensors"), "quick": args.quick,
                     "thread_settings": thread_settings(),
                     "gpu": {"available": torch.cuda.is_available(),
                             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}
    unknown = sorted(set(args.only or ()) - set(sections))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {sorted(sections)}")
    build = _build()
    if args.only and args.out.exists():  # re-run some sections into the figures of the others
        kept = json.loads(args.out.read_text())
        results = {**kept, **results, "section_builds": {**kept.get("section_builds", {}),
                                                         **{name: build for name in args.only}}}
    else:
        results["section_builds"] = {name: build for name in sections}
    for name, run in sections.items():
        if args.only and name not in args.only:
            continue
        log.info("%s ...", name)
        results[name] = run()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # after every section
    summary = [f"{k}: {v}" for k, v in {
        "teacher_inference.flop_fraction": results.get("teacher_inference", {}).get("flop_fraction"),
        "aggregator.p99_ms": results.get("aggregator", {}).get("p99_ms"),
        "end_to_end.digits_50_teachers.single_fresh_ms": results.get("end_to_end", {}).get(
            "digits_50_teachers", {}).get("single_fresh_ms"),
        "teacher_pool.speedup": results.get("teacher_pool", {}).get("speedup"),
    }.items()]
    print("perf: " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
