"""CPU shares of actors: never more than the CPUs split, short enough to read in a message, and
handed back before a stopped run returns."""
from __future__ import annotations

import pytest

from conclave.actors.placement import cpu_share


@pytest.mark.parametrize("cpus,parts,share", [(1, 3, 0.33), (2, 3, 0.66), (1, 1, 1.0), (1, 300, 0.0033),
                                              (0.5, 1, 0.5), (1e-5, 1, 0.0001)])
def test_a_cpu_share_is_rounded_down_to_hundredths_and_never_exceeds_the_cpus(cpus, parts, share):
    assert cpu_share(cpus, parts) == share
    assert str(share) == repr(cpu_share(cpus, parts))  # what a message prints: 0.33, not 0.3333333333333333
    assert parts * cpu_share(cpus, parts) <= max(cpus, 0.0001) + 1e-12


def test_released_actors_hand_their_cpus_back_before_it_returns(ray_session):
    """A run's stop waits for its actors' CPUs: the next run's placement sees them free at once."""
    import ray

    from conclave.actors.placement import release

    @ray.remote(num_cpus=0.5)
    class Holder:
        def ping(self) -> int:
            return 1

    free_before = ray.available_resources().get("CPU", 0.0)
    holders = [Holder.remote() for _ in range(2)]
    ray.get([holder.ping.remote() for holder in holders])
    release(holders, cpus_each=0.5)
    assert ray.available_resources().get("CPU", 0.0) >= free_before - 1e-6


def test_embedded_ray_workers_run_at_the_drivers_priority(ray_session):
    """Ray's default (niceness 15) starves a run's actors beside any ordinary process."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)
