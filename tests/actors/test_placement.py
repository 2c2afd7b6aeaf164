"""CPU shares of actors: never more than the CPUs split, and short enough to read in a message."""
from __future__ import annotations

import pytest

from conclave.actors.placement import cpu_share


@pytest.mark.parametrize("cpus,parts,share", [(1, 3, 0.33), (2, 3, 0.66), (1, 1, 1.0), (1, 300, 0.0033),
                                              (0.5, 1, 0.5), (1e-5, 1, 0.0001)])
def test_a_cpu_share_is_rounded_down_to_hundredths_and_never_exceeds_the_cpus(cpus, parts, share):
    assert cpu_share(cpus, parts) == share
    assert str(share) == repr(cpu_share(cpus, parts))  # what a message prints: 0.33, not 0.3333333333333333
    assert parts * cpu_share(cpus, parts) <= max(cpus, 0.0001) + 1e-12
