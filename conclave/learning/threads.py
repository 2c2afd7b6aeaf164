"""Thread settings for processes that share the machine's cores.

Our driver, teacher actors, student and benchmarks run side by side. Measured on 2 shared
cores, torch at 2 threads was 3–16× slower than at 1 when other processes used the cores,
and OpenMP threads spinning at barriers cost another 1.7× (``bench/perf.py`` measures it
again). So every process defaults to one torch thread, with passive OpenMP waiting; an actor
that reserves more CPUs sets as many threads itself. ``OMP_NUM_THREADS`` (and
``OMP_WAIT_POLICY``) in the environment override the defaults.

``share_cores()`` must run before torch is imported: OpenMP reads its settings once, at load.
This module therefore imports nothing heavy. It also keeps freed memory for reuse
(``learning.allocator``), the other setting every such process wants.
"""
from __future__ import annotations

import os
import sys

from conclave.learning.allocator import allocator_settings, keep_freed_memory

DEFAULTS = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def share_cores() -> None:
    """Default this process (and the Ray workers it starts, which inherit the environment) to
    one torch thread and passive OpenMP waiting, unless the environment says otherwise, and to
    glibc settings that keep freed memory for the next step."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    keep_freed_memory()
    torch = sys.modules.get("torch")
    if torch is not None:  # already loaded: OpenMP's wait policy is fixed, the count is not
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def thread_settings() -> dict[str, int | str]:
    """What a benchmark records about its threads (and the allocator settings beside them)."""
    import torch

    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            **{key: os.environ.get(key, "unset") for key in DEFAULTS}, **allocator_settings()}
