"""The allocator settings: applied to a fresh process, left alone where the user chose or opted
out, and carried to a joined cluster's workers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT

# In a fresh interpreter: apply the settings, then take a 64 MB block and count the mmapped blocks
# it added (mallinfo2's hblks). glibc's defaults give that block a mapping of its own.
PROBE = """
import ctypes, json
from conclave.learning.allocator import keep_freed_memory, allocator_settings

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

applied = keep_freed_memory()
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(ctypes.c_void_p(block))
print(json.dumps({"applied": applied, "mapped_blocks": mapped, "settings": allocator_settings()}))
"""


def _probe(**environment: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "CONCLAVE_KEEP_FREED_MEMORY")}
    completed = subprocess.run([sys.executable, "-c", PROBE], cwd=PROJECT_ROOT, env={**env, **environment},
                               capture_output=True, text=True, timeout=60, check=True)
    return json.loads(completed.stdout)


def test_a_fresh_process_serves_large_blocks_from_its_heap_and_passes_the_settings_on():
    probe = _probe()
    assert probe["applied"] is True
    assert probe["mapped_blocks"] == 0
    assert probe["settings"]["MALLOC_MMAP_MAX_"] == "0"  # in the environment its children start with


@pytest.mark.parametrize("environment", [{"CONCLAVE_KEEP_FREED_MEMORY": "0"}, {"MALLOC_MMAP_MAX_": "65536"},
                                         {"MALLOC_TOP_PAD_": "0"}])
def test_the_opt_out_or_a_users_own_setting_leaves_glibc_alone(environment):
    probe = _probe(**environment)
    assert probe["applied"] is False
    assert probe["mapped_blocks"] == 1
    assert probe["settings"]["MALLOC_TRIM_THRESHOLD_"] == "unset"


def test_a_joined_clusters_workers_get_the_settings_and_the_users_env_vars_win(monkeypatch):
    from conclave.cluster.ray_runtime import _with_allocator

    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    monkeypatch.setenv("MALLOC_TOP_PAD_", "67108864")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    merged = _with_allocator({"py_modules": ["pkg"], "env_vars": {"MALLOC_TOP_PAD_": "0", "MINE": "1"}})
    assert merged == {"py_modules": ["pkg"],
                      "env_vars": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TOP_PAD_": "0", "MINE": "1"}}
    monkeypatch.delenv("MALLOC_MMAP_MAX_")
    monkeypatch.delenv("MALLOC_TOP_PAD_")
    assert _with_allocator({}) is None
