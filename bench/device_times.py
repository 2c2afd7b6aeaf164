"""Benchmark: where a public-cluster MNIST run spends its time, on CPUs and on a GPU.

Times the product's own steps of ``configs/mnist-clusters.yaml`` on real MNIST (the 60,000
training images in the records' role, the 9,000-image pool, the 1,000 test images), each in a
fresh process, CPU-only (CUDA hidden) and GPU alternately, ``--repeats`` times:

  embedding   HOG-PCA (50 dims) fitted on the pool, applied to the pool and the 60,000 records
              (HOG in torch: on the GPU when the process sees one; the projection in numpy)
  features    ScatterNet coefficients of the pool and the test split: the student's inputs
  search      600 k-means clusters of the embedded pool and each record's 3 nearest medoids,
              counted into the [600 × 10] histogram (``privacy.cluster_histogram``): CPU code
              in both processes (no GPU path: it takes seconds, the student minutes)
  student     the config's student (FixMatch on ScatterNet features, its weights' average) for
              one epoch, with its augmented views: the per-epoch cost on each device
  ceiling     GPU only: the config's student in full on all 9,000 true pool labels (the
              non-private ceiling), and two larger students beside it (``--variants``)

Writes results/bench/device_times.json, ``sound: false``: it times work on the records (the
embedding and the search), a figure of them without a mechanism. Nothing else is released: no
record's vote leaves a process and no ε is stated (the ceiling reads the public pool's labels).
Runs without Ray, so that a GPU machine with torch alone can run it:

    python bench/device_times.py --mnist ../shared/data/mnist             # every stage
    python bench/device_times.py --mnist ../shared/data/mnist --quick     # one repeat, no variants
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soundness import soundness, timed_on, timed_private_work  # noqa: E402

CONFIG = ROOT / "configs" / "mnist-clusters.yaml"
STAGES = ("embedding", "features", "search", "student")
# Larger students than the shipped one, for the ceiling only (GPU): is the ceiling the model's?
VARIANTS = {"width 256": {"width": 256}, "60 epochs": {"epochs": 60}}


def _config():
    from conclave.cluster.api import load_pipeline, load_yaml

    return load_pipeline(load_yaml(CONFIG)).config


def _splits(root: str):
    from conclave.learning.data import make_splits

    config = _config()
    return config, make_splits("mnist", root, public_size=config.data.public_size, seed=config.seed)


def _student(config, splits, epochs: int | None = None, width: int | None = None) -> float:
    """The config's student trained on every pool image's true label, as ``Student._fit_fixmatch``
    trains it; its test accuracy."""
    from conclave.learning.data.features import apply_features, batch_transform
    from conclave.learning.models import build_model
    from conclave.learning.semi_supervised import fixmatch
    from conclave.learning.training import evaluate

    pool, test = splits.public, apply_features(splits.test, config.data.features)
    settings = config.student.semi_supervised
    if epochs is not None:
        settings = dataclasses.replace(settings, epochs=epochs)
    model = build_model(config.student.model if width is None else "scatternet_cnn", pool.num_classes,
                        input_shape=test.input_shape, seed=config.seed, **({} if width is None else {"width": width}))
    fixmatch(model, pool.x, pool.y, pool.x, settings, represent=batch_transform(config.data.features, pool.x.shape[-2:]))
    return evaluate(model, test)


def child(stage: str, root: str, options: dict) -> dict:
    """One stage, timed in this process (``main`` starts one process per stage and device)."""
    import numpy as np
    import torch

    from conclave.learning.training import default_device

    config, splits = _splits(root)
    pool, records = splits.public, splits.private
    result: dict = {"device": str(default_device()), "torch_threads": torch.get_num_threads()}
    started = time.perf_counter()
    if stage == "embedding":
        from conclave.learning.embeddings import fit_embedding

        embed = fit_embedding(config.clusters.embedding, pool.x, config.clusters.dims)
        embed(pool.x), embed(records.x)
    elif stage == "features":
        from conclave.learning.data.features import scatter

        scatter(pool.x), scatter(splits.test.x)
    elif stage == "search":
        from conclave.learning.embeddings import fit_embedding
        from conclave.learning.selection.clusters import cluster_pool
        from conclave.privacy.cluster_histogram import cluster_histogram

        embed = fit_embedding(config.clusters.embedding, pool.x, config.clusters.dims)
        embedded, points = embed(pool.x), np.asarray(embed(records.x), dtype=np.float64)
        started = time.perf_counter()  # the search alone: the embedding is the stage above
        clusters = cluster_pool(embedded, config.clusters.count, config.seed)
        cluster_histogram(points, records.y, embedded[clusters.medoids], config.clusters.votes_per_record,
                          records.num_classes)
    elif stage == "student":
        _student(config, splits, epochs=options.get("epochs", 1))
    elif stage == "ceiling":
        result["accuracy"] = _student(config, splits, options.get("epochs"), options.get("width"))
    else:
        raise ValueError(f"unknown stage {stage!r}")
    result["seconds"] = time.perf_counter() - started
    return result


def _run_child(stage: str, root: str, device: str, options: dict | None = None) -> dict:
    environment = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
    completed = subprocess.run([sys.executable, __file__, "--child", stage, "--mnist", root,
                                "--options", json.dumps(options or {})],
                               env=environment, capture_output=True, text=True, check=False)
    if completed.returncode:
        raise RuntimeError(f"{stage} on {device} failed:\n{completed.stderr[-3000:]}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    print(f"{stage:10s} {device:4s} {result['seconds']:8.2f} s  {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist", default=str(ROOT.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one repeat, no larger students")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "device_times.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.mnist, json.loads(args.options))))
        return

    import torch

    gpu = torch.cuda.is_available()
    devices = ("cpu", "gpu") if gpu else ("cpu",)
    repeats = 1 if args.quick else args.repeats
    seconds: dict[str, dict[str, list[float]]] = {stage: {d: [] for d in devices} for stage in STAGES}
    for _ in range(repeats):  # alternating: the machine's load drifts
        for stage in STAGES:
            for device in devices:
                seconds[stage][device].append(_run_child(stage, args.mnist, device)["seconds"])
    stages = {stage: {device: {"median_s": round(statistics.median(v), 2), "runs_s": [round(x, 2) for x in v]}
                      for device, v in by_device.items()} for stage, by_device in seconds.items()}
    if gpu:
        for stage in stages:
            stages[stage]["cpu_over_gpu"] = round(stages[stage]["cpu"]["median_s"] / stages[stage]["gpu"]["median_s"], 2)
    ceiling = {}
    if gpu:
        runs = {"shipped student": {}} | ({} if args.quick else VARIANTS)
        for name, options in runs.items():
            measured = _run_child("ceiling", args.mnist, "gpu", options)
            ceiling[name] = {"accuracy": measured["accuracy"], "seconds": round(measured["seconds"], 1), **options}
    result = {
        "benchmark": "device_times",
        # the embedding and the search run over the 60,000 records: their times are figures of them
        **soundness([timed_private_work("MNIST, its training split in the records' role")]),
        **timed_on("MNIST, its training split in the records' role"),
        "releases": "none: the stages run without noise and nothing leaves their process; the ceiling reads "
                    "the public pool's true labels (non-private, no ε)",
        "config": str(CONFIG.relative_to(ROOT)),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "gpu": torch.cuda.get_device_name(0) if gpu else None, "torch": torch.__version__},
        "records": 60_000, "pool": 9_000, "test": 1_000, "repeats": repeats,
        "stages": stages,
        "ceiling_on_gpu": ceiling,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
