"""Benchmark: the one-run audit's empirical lower bound beside the guarantee of the main configs.

For each config it runs ``conclave.cluster.auditing.run_audit`` — what ``conclave audit
CONFIG`` runs: canaries, one real run of the pipeline (teachers and the gRPC aggregator, or
DP-SGD on its shard actors), membership guesses, and the bound of Steinke, Nasr & Jagielski
(NeurIPS 2023, Thm 3.1) at 95% — and writes results/bench/audits.json: per config the bound, m,
r, v, the guarantee it sits under, the seconds taken (the benchmark's clock, on public stand-in
data: ``conclave audit`` publishes none) and ``sound``.

Configs with owners are not audited: the canaries would go into the owners' records, which stay
behind their gateways (``conclave audit`` refuses them in one line).

    python bench/audits.py                         # digits-teachers, digits-active, mnist-active
    python bench/audits.py --only digits-teachers  # some of them
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conclave.learning.threads import share_cores  # noqa: E402  (before torch loads)

share_cores()

from bench.soundness import soundness, timed_on  # noqa: E402
from conclave.cluster.api import AuditSettings, load_pipeline, load_yaml  # noqa: E402

log = logging.getLogger("bench.audits")

CONFIGS = {
    "digits-teachers": "configs/digits-teachers.yaml",  # the label audit needs teachers (the demo has none)
    "digits-active": "configs/digits-active.yaml",
    "mnist-active": "configs/mnist-active.yaml",
}


def audited(name: str, settings: AuditSettings) -> dict:
    pipeline = load_pipeline(load_yaml(ROOT / CONFIGS[name])).validate()
    started = time.perf_counter()
    try:
        result = pipeline.audit(settings)
    finally:
        import ray

        ray.shutdown()  # the next config starts its own Ray
    seconds = time.perf_counter() - started  # the benchmark's own clock: audits publish no time
    bound = result.bound
    log.info("%s: ε ≥ %.3f (m=%d, r=%d, v=%d) under ε = %.3f; %.0f s", name, bound.epsilon, bound.m, bound.r,
             bound.v, result.guarantee.epsilon, seconds)
    return {"config": CONFIGS[name], **result.as_dict(), "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), default=None, help="audit only these configs")
    parser.add_argument("--canaries", type=int, default=AuditSettings.canaries)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "audits.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.chdir(ROOT)  # the configs' data paths are relative to the project
    settings = AuditSettings(canaries=args.canaries)
    with tempfile.TemporaryDirectory(prefix="conclave-home-") as home:
        os.environ.setdefault("CONCLAVE_HOME", home)
        audits = {name: audited(name, settings) for name in CONFIGS if not args.only or name in args.only}
    reasons = [reason for audit in audits.values()
               for reason in audit["unsound_reasons"] + audit["guarantee"]["unsound_reasons"]]
    results = {"benchmark": "audits", **soundness(reasons),
               **timed_on("scikit-learn's digits and MNIST"),
               "canaries": args.canaries, "audits": audits}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print("audits: " + "; ".join(f"{name} ε ≥ {a['lower_bound']['epsilon']:.3f} under {a['guarantee']['epsilon']:.3f}"
                                 for name, a in audits.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
