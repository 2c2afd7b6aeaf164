"""Conclave: private teacher/student learning on Ray.

One import namespace over the project's folders: ``conclave.privacy`` (the DP math),
``conclave.learning`` (PyTorch and Opacus), ``conclave.actors`` (Ray actors),
``conclave.cluster`` (the library layer and the CLI over it), ``conclave.tuning`` (Ray Tune)
and ``conclave.protos`` (the aggregator's gRPC messages).
"""
from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "conclave-ray"  # "conclave" on the package index is another project

try:
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
