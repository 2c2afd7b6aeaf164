"""glibc malloc settings that keep freed memory for the next training step.

A DP-SGD step allocates and frees the same large tensors every step, and glibc's defaults return
them to the system, so each step page-faults them in again. ``keep_freed_memory()`` keeps up to
1 GiB of freed heap in this process and the ones it starts (``bench/perf.py``'s ``allocator``);
``CONCLAVE_KEEP_FREED_MEMORY=0`` or any malloc variable already set leaves glibc alone.
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
