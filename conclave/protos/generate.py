"""Regenerate the checked-in gRPC modules from ``aggregator.proto`` and ``owner.proto``.

``python -m conclave.protos.generate`` (or ``make proto``) rewrites ``aggregator_pb2.py``,
``aggregator_pb2_grpc.py`` and ``aggregator_pb2.pyi`` beside this file. protoc sees the proto
at ``conclave/protos/aggregator.proto`` (a copy in a scratch include tree, the path it has in
the installed package), so the generated gRPC module imports ``from conclave.protos import
aggregator_pb2`` — the package import works with no text patching, and the output depends only
on the proto and the grpcio-tools version. ``tests/protos/test_generated_fresh.py`` regenerates into a temporary
directory and fails when the checked-in modules are stale.
"""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

log = logging.getLogger(__name__)

PROTOS_DIR = Path(__file__).resolve().parent
PACKAGE_PATH = Path("conclave", "protos")  # where the protos sit in the import namespace
PROTO_FILES = ("aggregator.proto", "owner.proto")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generated_names() -> list[str]:
    """File names the protos produce, e.g. ``aggregator_pb2.py``."""
    return [Path(proto).stem + suffix for proto in PROTO_FILES for suffix in GENERATED_SUFFIXES]


def generate(out_dir: str | Path) -> list[Path]:
    """Compile every proto into ``out_dir`` (flat); returns the written paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="protoc-") as scratch:
        include, compiled = Path(scratch, "include"), Path(scratch, "out")
        (include / PACKAGE_PATH).mkdir(parents=True)
        compiled.mkdir()
        for proto in PROTO_FILES:
            shutil.copyfile(PROTOS_DIR / proto, include / PACKAGE_PATH / proto)
            args = [
                "grpc_tools.protoc",
                f"-I{include}",
                f"-I{well_known}",
                f"--python_out={compiled}",
                f"--pyi_out={compiled}",
                f"--grpc_python_out={compiled}",
                str(include / PACKAGE_PATH / proto),
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {PROTOS_DIR / proto}")
        written = []
        for name in generated_names():
            target = out_dir / name
            shutil.copyfile(compiled / PACKAGE_PATH / name, target)
            written.append(target)
    return written


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(PROTOS_DIR):
        log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
