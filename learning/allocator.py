"""glibc malloc settings that keep freed memory for the next training step.

A DP-SGD step allocates and frees the same large tensors every step: per-example gradients,
patches, a ResNet's activations. glibc serves an allocation above its mmap threshold (at most
32 MB) with a fresh mapping and unmaps it when freed, and returns the heap's free top to the
system beyond 128 kB (adaptively more), so every step pays a page fault for each 4 kB page it
touches again; on our 2 shared cores fresh memory is written at about 1 GB/s. Serving every
allocation from the heap and keeping up to 1 GiB of its free top took a book-keeping step of
the ResNet from 2.16× a plain step to 1.67× (``bench/perf.py``'s ``allocator``: a fresh
process of each setting per repetition, median of 5). The cost: a process keeps the memory it
has freed, up to 1 GiB beyond what it holds, instead of handing it back between steps, as
PyTorch's CUDA caching allocator does; its peak stays the same (the ResNet's steps: 1,446 MB
against 1,579 MB with glibc's defaults).

``keep_freed_memory()`` applies the settings to the calling process (``mallopt``) and puts them
in its environment, where glibc reads them in the processes it starts afterwards (Ray's
workers). ``CONCLAVE_KEEP_FREED_MEMORY=0`` keeps glibc's defaults, and any of these variables,
or ``GLIBC_TUNABLES``, already in the environment means the user chose: nothing is changed.
(Setting ``MALLOC_MMAP_MAX_`` to glibc's default value is not the default: any setting of it
turns off glibc's adaptive mmap threshold.) Off glibc it does nothing. This module imports
nothing heavy, so it runs before torch loads.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OPT_OUT = "CONCLAVE_KEEP_FREED_MEMORY"  # "0": leave glibc's defaults
# glibc's environment variable: its mallopt parameter (malloc.h) and our value.
SETTINGS = {
    "MALLOC_MMAP_MAX_": (-4, 0),  # M_MMAP_MAX: no allocation gets a mapping of its own
    "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap top
    "MALLOC_TOP_PAD_": (-2, 64 << 20),  # M_TOP_PAD: grow the heap 64 MB at a time
}


def keep_freed_memory() -> bool:
    """Apply ``SETTINGS`` to this process and its future children; whether they were applied."""
    if not _glibc():
        return False
    if os.environ.get(OPT_OUT) == "0" or "GLIBC_TUNABLES" in os.environ or any(name in os.environ for name in SETTINGS):
        return False
    libc = ctypes.CDLL(None)
    for name, (parameter, value) in SETTINGS.items():
        if libc.mallopt(parameter, value) != 1:
            log.warning("mallopt refused %s=%d; glibc's defaults stay for the processes this one starts", name, value)
            return False
    os.environ.update({name: str(value) for name, (_, value) in SETTINGS.items()})
    return True


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not glibc, or not POSIX
        return False


def allocator_settings() -> dict[str, str]:
    """What a benchmark records about the allocator."""
    return {name: os.environ.get(name, "unset") for name in (*SETTINGS, "GLIBC_TUNABLES", OPT_OUT)}
