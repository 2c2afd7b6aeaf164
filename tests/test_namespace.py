"""One import namespace: the installed project is ``conclave.…`` and nothing else."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import conclave

FOLDERS = ("privacy", "learning", "actors", "cluster", "tuning", "protos")


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_only_conclave_is_importable_from_outside_the_repo(tmp_path):
    # A user's own learning/ folder must shadow nothing of ours, and ours must not shadow theirs.
    for folder in FOLDERS:
        result = _python(f"import {folder}", tmp_path)
        assert result.returncode != 0 and "No module named" in result.stderr, folder
    result = _python("import conclave.cluster.cli, conclave.privacy.secure_sum, conclave.protos.aggregator_pb2_grpc; "
                     "print(conclave.__version__)", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == conclave.__version__


def test_version_names_the_distribution(tmp_path):
    result = subprocess.run([sys.executable, "-m", "conclave", "--version"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"conclave {conclave.__version__} ({conclave.DISTRIBUTION})"


def test_every_module_lies_at_the_path_its_name_spells():
    """``conclave.privacy.noise`` is the file conclave/privacy/noise.py (the root's privacy/ is a
    link to conclave/privacy/): a tool that resolves imports by path, not through the installed
    package, finds every module in its layer."""
    root = Path(__file__).resolve().parents[1]
    for folder in FOLDERS:
        for path in (root / folder).rglob("*.py"):
            spelled = root / "conclave" / path.relative_to(root)
            assert spelled.resolve() == path.resolve(), spelled
