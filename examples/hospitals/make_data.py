"""Three hospitals' tables, a public pool and a test table, made offline from scikit-learn's
bundled breast-cancer data (569 patients, 30 numeric columns, diagnosis benign/malignant).

    python examples/hospitals/make_data.py            # writes examples/hospitals/data/

Each hospital gets its own CSV (in a real deployment each sits on that hospital's machine);
the public pool has no labels; the test table keeps them to measure the student. The pool
again with the diagnosis an annotator would give (``annotated.csv``) is for active learning,
whose oracle annotator reveals the labels it is paid for, one by one. The split is fixed
(seed 0), so the files are the same on every machine.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer

HOSPITALS = ("hospital_a", "hospital_b", "hospital_c")
PUBLIC, TEST = 120, 150


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"), help="output folder")
    out = Path(parser.parse_args().out)
    frame = load_breast_cancer(as_frame=True).frame
    frame.columns = [c.replace(" ", "_") for c in frame.columns]
    frame["diagnosis"] = np.where(frame.pop("target") == 0, "malignant", "benign")
    frame = frame.sample(frac=1.0, random_state=0).reset_index(drop=True)
    test, public, rest = frame[:TEST], frame[TEST:TEST + PUBLIC], frame[TEST + PUBLIC:]
    (out / "public").mkdir(parents=True, exist_ok=True)
    test.to_csv(out / "public" / "test.csv", index=False)
    public.drop(columns="diagnosis").to_csv(out / "public" / "unlabeled.csv", index=False)
    public.to_csv(out / "public" / "annotated.csv", index=False)
    for name, part in zip(HOSPITALS, np.array_split(np.arange(len(rest)), len(HOSPITALS))):
        (out / name).mkdir(exist_ok=True)
        rest.iloc[part].to_csv(out / name / "records.csv", index=False)
    print(f"wrote {out}: {len(HOSPITALS)} hospitals of ~{len(rest) // len(HOSPITALS)} patients, "
          f"{PUBLIC} unlabeled public rows, {TEST} test rows")


if __name__ == "__main__":
    main()
