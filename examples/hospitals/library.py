"""The three-hospital example through the library API instead of the CLI.

    python examples/hospitals/library.py      # from the repository root

Builds the config in Python (the same shape as configs/hospitals.yaml), starts each hospital's
gateway on this machine, which trains its teachers on its records, serves them on 127.0.0.1
through the secure sum, lets a student learn from the private answers and prints what it
learned, the guarantee and each hospital's lifetime account.
"""
from __future__ import annotations

import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from conclave.cluster.api import (
    DataSource, MechanismConfig, OwnerBudget, OwnerConfig, PrivacyConfig, StudentConfig, TeachersConfig, TeacherStudentConfig,
    TrainConfig, serve, train_ensemble, train_student,
)

DATA = ROOT / "examples" / "hospitals" / "data"


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    owners = tuple(  # each declares its records (public) and, with no policy written here, its lifetime budget
        OwnerConfig(name, DataSource("csv", str(DATA / name / "records.csv"), label="diagnosis"), teachers=10,
                    records=records, budget=OwnerBudget(20.0))
        for name, records in (("hospital_a", 100), ("hospital_b", 100), ("hospital_c", 99)))
    config = TeacherStudentConfig(
        name="hospitals-library", owners=owners,
        public=DataSource("csv", str(DATA / "public" / "unlabeled.csv")),
        test=DataSource("csv", str(DATA / "public" / "test.csv"), label="diagnosis"),
        teachers=TeachersConfig(model="logistic_regression", train=TrainConfig(epochs=40, batch_size=8, lr=0.05)),
        mechanism=MechanismConfig("gnmax", {"sigma": 10.0}),
        privacy=PrivacyConfig(budget=5.0, delta=1e-5),
        student=StudentConfig(queries=40, batch_size=10, checkpoints=(20,), model="logistic_regression",
                              train=TrainConfig(epochs=60, batch_size=8, lr=0.05), pseudo_label_threshold=0.9),
    )
    with train_ensemble(config, progress=False) as ensemble:
        print(f"teachers: {ensemble.pool.num_teachers} behind the gateways {ensemble.nodes}")
        with serve(config, ensemble, ROOT / "results" / config.name / "ledger.sqlite") as aggregator:
            student = train_student(config, ensemble, aggregator, progress=False)
            aggregator.stop()
            report = aggregator.privacy_report()  # RunPrivacy: the guarantee first, the owners' accounts too
    print(f"student: {student.accuracy:.3f} test accuracy from {student.answered} of {student.asked} answered")
    print(report.headline())
    print(f"owners (lifetime budgets): {report.owners_line()}")


if __name__ == "__main__":
    main()
