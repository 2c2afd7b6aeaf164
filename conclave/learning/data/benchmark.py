"""A benchmark data set (``learning.data.load_dataset``) as an owner's or a public source:
its train or test part, whole."""
from __future__ import annotations

from conclave.learning.data.sources import DataSource, RawData


def read_benchmark(source: DataSource) -> RawData:
    from conclave.learning.data import load_dataset

    train, test = load_dataset(source.format, source.path)
    part = train if source.split == "train" else test
    return RawData(part.x, part.y)
