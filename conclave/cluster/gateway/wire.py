"""The owner protocol's messages as the gateway reads them: every field a coordinator sends is checked
against the protocol's bounds before anything uses it, and refused otherwise in one line with its gRPC
status (``Refused``: nothing was charged or released). Nothing is unpickled: a message carries typed
terms only, and its tensors are float32 bytes, checked finite.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from conclave.errors import ConclaveError
from conclave.learning.data.schema import Standardiser
from conclave.learning.data.sources import PublicReading
from conclave.learning.models import factory_of
from conclave.learning.models.contract import HINTS, declared_parameters
from conclave.learning.trained_entries import TrainedEntries
from conclave.protos import owner_pb2

# The protocol's bounds on what any run may ask:
MAX_BATCH = 4096  # the most queries one round may carry (and the largest training batch)
MAX_SEED = 2**31 - 1
MAX_ROUNDS = 1_000_000
MAX_COLUMNS, MAX_IMAGE_SIDE = 100_000, 16_384  # the most a public reading may name
MAX_ARGUMENTS = 16  # the most keyword arguments a run may give a registered model
INPUTS_DTYPE, SHARE_DTYPE = "float32", "int64"


class Refused(ConclaveError):
    """A call refused with ``code``, in one line (``message``); nothing was charged or released."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse(kind: type[Message], raw: bytes) -> Message:
    """``raw`` as a ``kind`` message; refused if it does not decode or carries undeclared fields."""
    message = kind()
    try:
        message.ParseFromString(raw)
    except DecodeError:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"not a {kind.DESCRIPTOR.name} message") from None
    size = message.ByteSize()
    message.DiscardUnknownFields()
    if message.ByteSize() != size:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"the {kind.DESCRIPTOR.name} carries fields the owner protocol does not declare (e.g. a "
                      "runtime_env): a gateway takes typed terms only")
    return message


def decode_tensor(tensor: owner_pb2.Tensor, what: str, trailing: tuple[int, ...] | None = None) -> np.ndarray:
    """A float32 tensor ``[n, *trailing]`` with finite values (``trailing`` None: any shape of rank ≥ 2)."""
    shape = tuple(int(d) for d in tensor.shape)
    if tensor.dtype != INPUTS_DTYPE:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{what}: dtype {tensor.dtype[:20]!r} is not accepted; send float32 (little-endian)")
    if len(shape) < 2 or min(shape) < 1 or (trailing is not None and shape[1:] != trailing):
        wanted = f"[n, {', '.join(map(str, trailing))}]" if trailing is not None else "[n, ...] with every dimension >= 1"
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: shape {list(shape)[:8]} is not {wanted}")
    if len(tensor.data) != math.prod(shape) * 4:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{what}: {len(tensor.data)} bytes, but shape {list(shape)} of float32 needs {math.prod(shape) * 4}")
    values = np.frombuffer(tensor.data, dtype="<f4").reshape(shape)
    if not np.isfinite(values).all():
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: NaN or infinity")
    return values


def decode_reading(reading: owner_pb2.PublicReading) -> PublicReading:
    """How the run reads the owner's data (``PublicReading``: public figures of the pool), or a refusal."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    columns, fill, size = tuple(reading.columns), tuple(reading.fill), tuple(int(d) for d in reading.image_size)
    if len(columns) > MAX_COLUMNS or any(not c or len(c) > 200 or not c.isprintable() for c in columns):
        raise Refused(invalid, f"reading.columns: at most {MAX_COLUMNS} names, each printable, 1 to 200 characters")
    if len(set(columns)) != len(columns):
        raise Refused(invalid, "reading.columns: a column named twice")
    if fill and (len(fill) != len(columns) or not all(math.isfinite(v) for v in fill)):
        raise Refused(invalid, f"reading.fill: one finite value per column ({len(columns)}), or none")
    if size and (len(size) != 2 or not all(1 <= d <= MAX_IMAGE_SIDE for d in size)):
        raise Refused(invalid, f"reading.image_size: [height, width] in [1, {MAX_IMAGE_SIDE}], or none")
    return PublicReading(columns or None, (size[0], size[1]) if size else None, fill or None)


def decode_standardiser(terms: owner_pb2.DpsgdTerms, input_shape: tuple[int, ...]) -> Standardiser | None:
    """A table model's input scaling (the public pool's column statistics, and the columns it reads),
    or None; else a refusal."""
    if not terms.HasField("standardiser"):
        return None
    mean, scale = np.array(terms.standardiser.mean), np.array(terms.standardiser.scale)
    if len(input_shape) != 1 or mean.shape != (input_shape[0],) or scale.shape != mean.shape:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"dpsgd.standardiser: one mean and one scale per column of a "
                                                        f"table ({input_shape[0] if len(input_shape) == 1 else 0}), "
                                                        "or none")
    if not (np.isfinite(mean).all() and np.isfinite(scale).all() and (scale > 0).all()):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "dpsgd.standardiser: finite means and scales > 0")
    keep = np.array(terms.standardiser.keep, dtype=bool)
    if len(keep) and (keep.shape != mean.shape or not keep.any()):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"dpsgd.standardiser.keep: one flag per column "
                                                        f"({len(mean)}), at least one kept, or none (every column)")
    return Standardiser(mean.astype(np.float32), scale.astype(np.float32), keep if len(keep) else None)


def check_run_name(run: str) -> None:
    if not run or len(run) > 200 or not run.isprintable():
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "run: name the run (printable, at most 200 characters)")


def decode_weights(tensors: Sequence[owner_pb2.Tensor], shapes: tuple[tuple[int, ...], ...],
                   what: str = "weights") -> list[np.ndarray]:
    """The model's parameters as sent (``what``: the field): float32 tensors of exactly ``shapes``, in
    order, finite."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if len(tensors) != len(shapes):
        raise Refused(invalid, f"{what}: {len(tensors)} tensors, but the model has {len(shapes)} parameters")
    weights = []
    for index, (tensor, shape) in enumerate(zip(tensors, shapes)):
        sent = tuple(int(d) for d in tensor.shape)
        if tensor.dtype != INPUTS_DTYPE:
            raise Refused(invalid, f"{what}[{index}]: dtype {tensor.dtype[:20]!r} is not accepted; send float32")
        if sent != shape or len(tensor.data) != math.prod(shape) * 4:
            raise Refused(invalid, f"{what}[{index}]: shape {list(sent)[:8]} ({len(tensor.data)} bytes) is not the "
                                   f"model's {list(shape)} of float32")
        values = np.frombuffer(tensor.data, dtype="<f4").reshape(shape)
        if not np.isfinite(values).all():
            raise Refused(invalid, f"{what}[{index}]: NaN or infinity")
        weights.append(values)
    return weights


def decode_vector(tensor: owner_pb2.Tensor, what: str, size: int) -> np.ndarray:
    """A float32 vector of ``size`` finite values."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    sent = tuple(int(d) for d in tensor.shape)
    if tensor.dtype != INPUTS_DTYPE:
        raise Refused(invalid, f"{what}: dtype {tensor.dtype[:20]!r} is not accepted; send float32")
    if sent != (size,) or len(tensor.data) != size * 4:
        raise Refused(invalid, f"{what}: shape {list(sent)[:8]} ({len(tensor.data)} bytes) is not [{size}] of float32")
    values = np.frombuffer(tensor.data, dtype="<f4")
    if not np.isfinite(values).all():
        raise Refused(invalid, f"{what}: NaN or infinity")
    return values


def decode_arguments(terms: owner_pb2.DpsgdTerms) -> dict[str, int | float]:
    """The registered model's own keyword arguments (numbers, each one it declares beyond the contract's)."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    declared = set(declared_parameters(factory_of(terms.model))) - {"num_classes", *HINTS}
    if len(terms.arguments) > MAX_ARGUMENTS:
        raise Refused(invalid, f"dpsgd.arguments: at most {MAX_ARGUMENTS}")
    arguments: dict[str, int | float] = {}
    for argument in terms.arguments:
        kind = argument.WhichOneof("value")
        if argument.name not in declared or argument.name in arguments:
            takes = ", ".join(sorted(declared)) or "none"
            raise Refused(invalid, f"dpsgd.arguments: model {terms.model} takes {takes}, each once; not "
                                   f"{argument.name[:40]!r}")
        value = argument.integer if kind == "integer" else argument.real
        if kind is None or not math.isfinite(value):
            raise Refused(invalid, f"dpsgd.arguments: {argument.name} needs a finite number")
        arguments[argument.name] = value
    return arguments


def decode_trained(sparse: owner_pb2.SparseTerms, shapes: tuple[tuple[int, ...], ...]) -> TrainedEntries:
    """The public mask of a sparse run, within the model's shapes."""
    entries = tuple((int(t.parameter), np.array(t.entries, dtype=np.int64) if t.entries else None)
                    for t in sparse.trained)
    try:
        return TrainedEntries(shapes, entries)
    except ValueError as err:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"sparse.trained: {err}") from None
