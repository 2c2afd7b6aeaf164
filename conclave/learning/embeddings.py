"""Fixed public embeddings for kNN votes: where the records' nearest neighbours are measured.

An embedding here is fitted on PUBLIC data only (the student's pool) or on nothing, and maps
each input alone, so it costs no privacy: the owners' actors embed their records with it on
their own nodes, the aggregator embeds the (public) queries the same way. Fitting anything on
private records would be a release of its own.

What a config can name (``fit_embedding``):
- a name in ``EMBEDDINGS``: a ``NamedEmbedding`` class, which says what it is (``about``) and how
  it is fitted; adding one is its class here and one line in ``register``'s list;
- ``"network:PATH"``: a trained network's activations before its logits, from a checkpoint a
  run wrote (``student.pt``: the student of an earlier round, trained on released labels and
  public inputs only, so using it is post-processing; that round's ε composes with this one's);
- ``"package.module:function"``: a user's own, e.g. a public-pretrained encoder;
  ``function(public_inputs, dims)`` returns a picklable callable ``inputs → float [n, d]``
  (ship the package to the workers with ``runtime_env``).
"""
from __future__ import annotations

import abc
import functools
import importlib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.exact_distances import exact_projection



class Embedding(Protocol):
    """A fixed public map of inputs to vectors. ``__call__`` embeds public inputs (queries, the pool)
    in whatever batches are fastest; ``records`` embeds an owner's records so that each record's
    vector is a function of that record alone, bit for bit, whatever records sit beside it (the
    one-record lemmas of kNN and cluster votes rest on it; docs/privacy.md)."""

    def __call__(self, inputs: np.ndarray) -> np.ndarray: ...

    def records(self, inputs: np.ndarray) -> np.ndarray: ...


NETWORK = "network:"  # prefix of a checkpoint path
# Inputs embedded at a time: scattering 60,000 MNIST images at once would hold ~1 GB of
# coefficients; in chunks only the projections (dims floats each) are kept.
EMBED_CHUNK = 2048


class NamedEmbedding(abc.ABC):
    """An embedding a config can name: ``name``, one line ``about`` it, and ``fit``, which makes it
    from the public pool alone (or from nothing); an instance maps inputs to vectors."""

    name: ClassVar[str]
    about: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def fit(cls, public_inputs: np.ndarray, dims: int) -> NamedEmbedding:
        """The embedding fitted on ``public_inputs`` (``dims``: the dimensions it keeps, where it chooses)."""

    @abc.abstractmethod
    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        """float [n, d] for inputs [n, *shape]."""

    def records(self, inputs: np.ndarray) -> np.ndarray:
        """float [n, d], each record embedded alone (``Embedding``); subclasses may do it faster."""
        return one_at_a_time(self, inputs)


@dataclass(frozen=True)
class Flatten(NamedEmbedding):
    """Each input as one float vector: the identity embedding (raw pixels or table rows)."""

    name: ClassVar[str] = "flatten"
    about: ClassVar[str] = "the inputs as they are, one vector each (raw pixels, table rows)"

    @classmethod
    def fit(cls, public_inputs: np.ndarray, dims: int) -> Flatten:
        return cls()

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        inputs = np.asarray(inputs, dtype=np.float32)
        return inputs.reshape(len(inputs), math.prod(inputs.shape[1:]))  # also for no inputs at all

    def records(self, inputs: np.ndarray) -> np.ndarray:
        return self(inputs)  # a cast and a reshape: elementwise


@dataclass(frozen=True)
class PublicPCA(NamedEmbedding):
    """Projection of (optionally ``features``-transformed) flattened inputs onto the top principal
    directions of PUBLIC data (``fit`` on the public pool only), optionally standardised first;
    its subclasses below differ in what they project (``projects``, ``standardised``)."""

    name: ClassVar[str] = "pca"
    about: ClassVar[str] = "flattened inputs projected on the public pool's top dims principal directions"
    projects: ClassVar[str | None] = None  # the fixed features projected (learning.data.features); None: the inputs
    standardised: ClassVar[bool] = False  # each value scaled by its spread over the public pool first

    mean: np.ndarray  # float32 [d]
    components: np.ndarray  # float32 [dims, d], orthonormal rows
    scale: np.ndarray | float = 1.0  # float32 [d]: each value's public spread, when standardised

    @classmethod
    def fit(cls, public_inputs: np.ndarray, dims: int) -> PublicPCA:
        flat = _represent(public_inputs, cls.projects).astype(np.float64)
        if not 1 <= dims <= min(flat.shape):
            raise InvalidValue(f"dims must be in [1, {min(flat.shape)}] for {flat.shape[0]} public inputs of "
                             f"{flat.shape[1]} values, got {dims}")
        mean = flat.mean(axis=0)
        spread = flat.std(axis=0)
        scale = np.where(spread > 0, spread, 1.0).astype(np.float32) if cls.standardised else 1.0  # constants stay
        _, _, vt = np.linalg.svd((flat - mean) / scale, full_matrices=False)
        return cls(mean.astype(np.float32), vt[:dims].astype(np.float32), scale)

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        parts = [((_represent(inputs[start:start + EMBED_CHUNK], self.projects) - self.mean) / self.scale)
                 @ self.components.T
                 for start in range(0, len(inputs), EMBED_CHUNK)]
        return np.concatenate(parts) if parts else np.zeros((0, len(self.components)), dtype=np.float32)

    def records(self, inputs: np.ndarray) -> np.ndarray:
        """The projection summed in a fixed order, one elementwise operation at a time, so each
        record's vector has the same bits wherever it sits (a matrix product's need not); the
        features are the shipped per-image transforms (``learning.data.features``)."""
        components = self.components.astype(np.float64)
        parts = [exact_projection((_represent(inputs[start:start + EMBED_CHUNK], self.projects) - self.mean) / self.scale,
                              components)
                 for start in range(0, len(inputs), EMBED_CHUNK)]
        return np.concatenate(parts) if parts else np.zeros((0, len(self.components)), dtype=np.float32)


def one_at_a_time(embed: Callable[[np.ndarray], np.ndarray], inputs: np.ndarray) -> np.ndarray:
    """``embed`` applied to each input alone, in a fresh copy: the same call on the same bits, so
    each vector is a function of its own input whatever the batch (slower than a batch)."""
    parts = [np.asarray(embed(np.array(inputs[i:i + 1])), dtype=np.float32) for i in range(len(inputs))]
    return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)


class StandardisedPCA(PublicPCA):
    name: ClassVar[str] = "standardised-pca"
    about: ClassVar[str] = ("PCA after scaling each value by its spread over the public pool (table columns in "
                            "different units: one column must not decide the distances)")
    standardised: ClassVar[bool] = True


class ScatteringPCA(PublicPCA):
    name: ClassVar[str] = "scattering-pca"
    about: ClassVar[str] = ("ScatterNet coefficients of the images, then PCA fitted on the public pool's "
                            "coefficients — the issue's measurement: the embedding decides")
    projects: ClassVar[str | None] = "scattering"


class HogPCA(PublicPCA):
    name: ClassVar[str] = "hog-pca"
    about: ClassVar[str] = ("HOG features of the images, then PCA (Private-kNN's choice; on MNIST its neighbours "
                            "are purer)")
    projects: ClassVar[str | None] = "hog"


EMBEDDINGS: dict[str, type[NamedEmbedding]] = {}


def register(cls: type[NamedEmbedding]) -> type[NamedEmbedding]:
    """Make ``cls`` an embedding configs can name: a concrete ``NamedEmbedding`` with a new name
    (no ':', which marks the other forms) and a line ``about`` it (TypeError naming what is
    missing). Returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, NamedEmbedding)) or inspect.isabstract(cls):
        raise TypeError(f"embedding class {cls!r} cannot be registered: it is not a concrete NamedEmbedding")
    name, about = getattr(cls, "name", None), getattr(cls, "about", None)
    if not (isinstance(name, str) and name and ":" not in name) or EMBEDDINGS.get(name, cls) is not cls:
        raise TypeError(f"embedding class {cls.__name__} cannot be registered: its name {name!r} is not a new name "
                        "without ':'")
    if not (isinstance(about, str) and about):
        raise TypeError(f"embedding class {cls.__name__} cannot be registered: it says nothing about itself")
    EMBEDDINGS[name] = cls
    return cls


for shipped in (Flatten, PublicPCA, StandardisedPCA, ScatteringPCA, HogPCA):
    register(shipped)


def check_embedding(name: str, where: str = "embedding") -> None:
    """Refuse a name that is neither registered, a network checkpoint nor ``module:function`` (no
    import: configs load without torch)."""
    if name in EMBEDDINGS or (name.startswith(NETWORK) and len(name) > len(NETWORK)):
        return
    module, _, function = name.partition(":")
    if not (module and function and all(part.isidentifier() for part in module.split("."))
            and function.isidentifier()):
        raise InvalidValue(f"{where} must be one of {list(EMBEDDINGS)}, 'network:PATH' or 'package.module:function', "
                         f"got {name!r}")


def _represent(inputs: np.ndarray, features: str | None) -> np.ndarray:
    if features is not None:
        from conclave.learning.data.features import features_of

        inputs = features_of(np.asarray(inputs, dtype=np.float32), features)
    return Flatten()(inputs)


@dataclass(frozen=True)
class NetworkEmbedding:
    """A trained network's activations before its logits (``model.features``), on its inputs'
    ``features`` representation; saved as a plain checkpoint (names, shapes and tensors only, so
    loading it runs no pickled code). ``lineage``: the privacy bounds of the runs whose releases
    trained it (plain values, ``privacy.accounting.composition.PublishedRun.as_record``), so a
    round that embeds with it states the composition with them."""

    model: str  # a learning.models name
    num_classes: int
    input_shape: tuple[int, ...]  # what the network reads (after ``features``)
    features: str | None
    state: dict[str, np.ndarray] = field(repr=False)
    lineage: tuple[dict, ...] = field(default=(), repr=False)

    def save(self, path: str | Path) -> None:
        import torch

        torch.save({"model": self.model, "num_classes": self.num_classes, "input_shape": list(self.input_shape),
                    "features": self.features, "state_dict": {k: torch.tensor(v) for k, v in self.state.items()},
                    "lineage": list(self.lineage)}, path)

    @classmethod
    def load(cls, path: str | Path) -> NetworkEmbedding:
        import torch

        try:
            saved = torch.load(path, weights_only=True)
            return cls(saved["model"], int(saved["num_classes"]), tuple(saved["input_shape"]), saved["features"],
                       {k: v.numpy() for k, v in saved["state_dict"].items()}, tuple(saved.get("lineage", ())))
        except (OSError, KeyError, RuntimeError) as err:
            raise InvalidValue(f"network checkpoint {path}: {str(err).splitlines()[0]}") from err

    @functools.cached_property
    def _network(self) -> Any:
        import torch

        from conclave.learning.models import build_model

        network = build_model(self.model, self.num_classes, input_shape=self.input_shape)
        network.load_state_dict({k: torch.tensor(v) for k, v in self.state.items()})
        return network

    def __getstate__(self) -> dict:  # the built network stays in the process that built it
        return {k: v for k, v in self.__dict__.items() if k != "_network"}

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        from conclave.learning.data.features import features_of
        from conclave.learning.training import embed

        parts = [embed(self._network, features_of(np.asarray(inputs[start:start + EMBED_CHUNK], dtype=np.float32),
                                                  self.features))
                 for start in range(0, len(inputs), EMBED_CHUNK)]
        return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)

    def records(self, inputs: np.ndarray) -> np.ndarray:
        """The network run on one record at a time (a batch's kernels round a row by its
        neighbours; a batch of one always takes the same path); features per image as above."""
        from conclave.learning.data.features import features_of
        from conclave.learning.training import embed

        parts = [embed(self._network, features_of(np.asarray(inputs[start:start + EMBED_CHUNK], dtype=np.float32),
                                                  self.features), batch_size=1)
                 for start in range(0, len(inputs), EMBED_CHUNK)]
        return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)


@dataclass(frozen=True)
class UserEmbedding:
    """A user's ``module:function`` embedding: public inputs as the function batches them, records
    one at a time (``one_at_a_time``: nothing is known of how the function rounds a batch)."""

    function: Callable[[np.ndarray], np.ndarray]

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        return self.function(inputs)

    def records(self, inputs: np.ndarray) -> np.ndarray:
        return one_at_a_time(self.function, inputs)


def fit_embedding(name: str, public_inputs: np.ndarray, dims: int) -> Embedding:
    """The embedding ``name`` (module docstring), fitted on ``public_inputs`` where it fits anything
    (``dims``: the PCA's; a network's activations are used as they are)."""
    check_embedding(name)
    if name.startswith(NETWORK):
        return NetworkEmbedding.load(name[len(NETWORK):])
    if name in EMBEDDINGS:
        return EMBEDDINGS[name].fit(public_inputs, dims)
    module, _, function = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as err:
        raise InvalidValue(f"embedding {name!r}: {err}") from err
    return UserEmbedding(factory(public_inputs, dims))
