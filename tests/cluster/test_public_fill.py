"""Missing cells in every table of a run take the public pool's column means (``PublicData.read``,
``owner_data``): the pool's own cells and the test table's too, and never a statistic of an owner's."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conclave.cluster.owners import DataOwner, PublicData, owner_data
from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource


def test_missing_cells_take_the_pools_means_in_every_table_never_an_owners(tmp_path):
    nan = np.nan
    tables = {"pool": pd.DataFrame({"a": [1.0, 3.0, nan, 5.0], "b": [10.0, nan, 30.0, 20.0]}),  # means 3 and 20
              "test": pd.DataFrame({"b": [1.0, nan], "a": [nan, 2.0], "label": ["x", "y"]}),  # its own column order
              "owner": pd.DataFrame({"a": [1000.0, nan, 1000.0], "b": [nan, -1000.0, -1000.0],
                                     "label": ["x", "y", "x"]})}
    for name, frame in tables.items():
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
    public = PublicData.read(DataSource("csv", str(tmp_path / "pool.csv")),
                             DataSource("csv", str(tmp_path / "test.csv"), label="label"), None)
    assert public.splits.public.x.tolist() == [[1, 10], [3, 20], [3, 30], [5, 20]]
    assert public.splits.test.x.tolist() == [[3, 1], [2, 20]]
    assert public.reading.fill == pytest.approx((3.0, 20.0))
    owner = DataOwner("o", DataSource("csv", "owner.csv", label="label"), records=3)
    records, check = owner_data(owner, public.reading, str(tmp_path)).read_private(public.classes)
    assert records.x.tolist() == [[1000, 20], [3, -1000], [1000, -1000]]  # the pool's means, not the owner's
    assert sorted(check.filled) == [0, 1] and not check.problems
    pd.DataFrame({"a": [1.0, 2.0], "b": [nan, nan]}).to_csv(tmp_path / "empty-column.csv", index=False)
    with pytest.raises(DataFormatError, match=r"no usable value in column\(s\) \['b'\]"):
        PublicData.read(DataSource("csv", str(tmp_path / "empty-column.csv")),
                        DataSource("csv", str(tmp_path / "test.csv"), label="label"), None)
