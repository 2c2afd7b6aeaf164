"""Conclave: private teacher/student learning on Ray.

One import namespace over the project's folders: ``conclave.privacy`` (the DP math),
``conclave.learning`` (PyTorch and Opacus), ``conclave.actors`` (Ray actors),
``conclave.cluster`` (the library layer and the CLI over it), ``conclave.tuning`` (Ray Tune)
and ``conclave.protos`` (the aggregator's gRPC messages).

Importing it costs nothing: ``__version__`` is read from the installed metadata when first
asked for (``importlib.metadata`` takes tens of milliseconds, in which a Ctrl-C at the
command's start would otherwise land in an import).
"""
from __future__ import annotations

DISTRIBUTION = "conclave-ray"  # "conclave" on the package index is another project


def __getattr__(name: str) -> str:
    if name != "__version__":
        raise AttributeError(f"module 'conclave' has no attribute {name!r}")
    from importlib import metadata

    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        version = "0+unknown"
    globals()["__version__"] = version
    return version
