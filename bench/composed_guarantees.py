"""What the README's MNIST teacher/student table publishes from the same private data, together.

Every row of `bench/teacher_student_mnist.py` comes from teachers trained on the same 60,000
MNIST training images, so publishing the rows together is one release of that data. For each
group of rows this composes the runs' bounds (``privacy.accounting.composition``: each run's
planned worst case, lowered to its budget at its filter's order) from the runs' configs alone —
public settings, no data is read — and writes ``results/bench/composed_guarantees.json``.

    python bench/composed_guarantees.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.teacher_student_mnist import CONFIGS, load_config  # noqa: E402
from conclave.cluster.api import TeacherStudent  # noqa: E402
from conclave.privacy.accounting.composition import PublishedRun, composed_guarantee  # noqa: E402

DELTA = 1e-5
SCATTERNET = ("mnist-gnmax-scatternet", "mnist-gnmax-scatternet-eps1", "mnist-gnmax-scatternet-eps047")
KNN = ("mnist-knn", "mnist-knn-eps1", "mnist-knn-eps2")
ROUNDS = ("mnist-knn-r1", "mnist-knn-r2")
GROUPS = {
    "the three ScatterNet rows (one set of teachers)": SCATTERNET,
    "the three kNN rows": KNN,
    "the two kNN rounds (the second on the first's student)": ROUNDS,
    "every row with a finite guarantee": (*KNN, *ROUNDS, *SCATTERNET, "mnist-gnmax", "mnist-lnmax"),
    "the whole table": CONFIGS,
}


def published_run(name: str) -> PublishedRun:
    config = load_config(name, ROOT.parent / "shared" / "data" / "mnist", quick=False)
    planned = TeacherStudent(config).plan()
    return PublishedRun(name, planned, config.privacy.budget_filter(planned))


def main() -> int:
    runs = {name: published_run(name) for name in CONFIGS}
    report = {"sound": True, "unsound_reasons": [], "delta": DELTA, "source": "results/bench/teacher_student_mnist.json",
              "groups": {}}
    for group, names in GROUPS.items():
        guarantee = composed_guarantee([runs[n] for n in names], DELTA)
        report["groups"][group] = {"runs": list(names), "guarantee": guarantee.as_dict()}
        print(f"{group}: ε = {guarantee.epsilon:.3g} at δ = {DELTA:g} ({guarantee.basis})")
    target = ROOT / "results" / "bench" / "composed_guarantees.json"
    target.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
