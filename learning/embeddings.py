"""Fixed public embeddings for kNN votes: where the records' nearest neighbours are measured.

An embedding here is fitted on PUBLIC data only (the student's pool) or on nothing, and maps
each input alone, so it costs no privacy: the owners' actors embed their records with it on
their own nodes, the aggregator embeds the (public) queries the same way. Fitting anything on
private records would be a release of its own.

Names a config can give (``fit_embedding``):
- ``flatten``: the inputs as they are, one vector each (raw pixels, table rows);
- ``pca``: flattened inputs projected on the public pool's top ``dims`` principal directions;
- ``standardised-pca``: the same after scaling each value by its spread over the public pool
  (table columns in different units: one column must not decide the distances);
- ``scattering-pca``: ScatterNet coefficients (``learning.data.features``) of the images, then
  PCA fitted on the public pool's coefficients — the issue's measurement: the embedding decides;
- ``hog-pca``: the same on HOG features (Private-kNN's choice; on MNIST its neighbours are purer);
- ``"network:PATH"``: a trained network's activations before its logits, from a checkpoint a
  run wrote (``student.pt``: the student of an earlier round, trained on released labels and
  public inputs only, so using it is post-processing; that round's ε composes with this one's);
- ``"package.module:function"``: a user's own, e.g. a public-pretrained encoder;
  ``function(public_inputs, dims)`` returns a picklable callable ``inputs → float [n, d]``
  (ship the package to the workers with ``runtime_env``).
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

Embedding = Callable[[np.ndarray], np.ndarray]  # inputs [n, *shape] → float [n, d]; fixed and public

EMBEDDINGS = ("flatten", "pca", "standardised-pca", "scattering-pca", "hog-pca")
# The PCA embeddings: name → (the fixed features it projects, whether standardised first).
PCA_EMBEDDINGS = {"pca": (None, False), "standardised-pca": (None, True), "scattering-pca": ("scattering", False),
                  "hog-pca": ("hog", False)}
NETWORK = "network:"  # prefix of a checkpoint path
# Inputs embedded at a time: scattering 60,000 MNIST images at once would hold ~1 GB of
# coefficients; in chunks only the projections (dims floats each) are kept.
EMBED_CHUNK = 2048


def check_embedding(name: str, where: str = "embedding") -> None:
    """Refuse a name that is neither built in nor ``module:function`` (no import: configs load
    without torch)."""
    if name in EMBEDDINGS or (name.startswith(NETWORK) and len(name) > len(NETWORK)):
        return
    module, _, function = name.partition(":")
    if not (module and function and all(part.isidentifier() for part in module.split("."))
            and function.isidentifier()):
        raise ValueError(f"{where} must be one of {list(EMBEDDINGS)}, 'network:PATH' or 'package.module:function', "
                         f"got {name!r}")


@dataclass(frozen=True)
class Flatten:
    """Each input as one float vector: the identity embedding (raw pixels or table rows)."""

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        inputs = np.asarray(inputs, dtype=np.float32)
        return inputs.reshape(len(inputs), math.prod(inputs.shape[1:]))  # also for no inputs at all


@dataclass(frozen=True)
class PublicPCA:
    """Projection of (optionally ``features``-transformed) flattened inputs onto the top principal
    directions of PUBLIC data (``fit`` on the public pool only), optionally standardised first."""

    mean: np.ndarray  # float32 [d]
    components: np.ndarray  # float32 [dims, d], orthonormal rows
    features: str | None = None  # a fixed transform applied first (learning.data.features)
    scale: np.ndarray | float = 1.0  # float32 [d]: each value's public spread, when standardised

    @classmethod
    def fit(cls, public_inputs: np.ndarray, dims: int, features: str | None = None,
            standardise: bool = False) -> PublicPCA:
        flat = _represent(public_inputs, features).astype(np.float64)
        if not 1 <= dims <= min(flat.shape):
            raise ValueError(f"dims must be in [1, {min(flat.shape)}] for {flat.shape[0]} public inputs of "
                             f"{flat.shape[1]} values, got {dims}")
        mean = flat.mean(axis=0)
        spread = flat.std(axis=0)
        scale = np.where(spread > 0, spread, 1.0).astype(np.float32) if standardise else 1.0  # constants stay put
        _, _, vt = np.linalg.svd((flat - mean) / scale, full_matrices=False)
        return cls(mean.astype(np.float32), vt[:dims].astype(np.float32), features, scale)

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        parts = [((_represent(inputs[start:start + EMBED_CHUNK], self.features) - self.mean) / self.scale)
                 @ self.components.T
                 for start in range(0, len(inputs), EMBED_CHUNK)]
        return np.concatenate(parts) if parts else np.zeros((0, len(self.components)), dtype=np.float32)


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
            raise ValueError(f"network checkpoint {path}: {str(err).splitlines()[0]}") from err

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


def fit_embedding(name: str, public_inputs: np.ndarray, dims: int) -> Embedding:
    """The embedding ``name`` (module docstring), fitted on ``public_inputs`` where it fits anything
    (``dims``: the PCA's; a network's activations are used as they are)."""
    check_embedding(name)
    if name.startswith(NETWORK):
        return NetworkEmbedding.load(name[len(NETWORK):])
    if name == "flatten":
        return Flatten()
    if name in PCA_EMBEDDINGS:
        features, standardise = PCA_EMBEDDINGS[name]
        return PublicPCA.fit(public_inputs, dims, features, standardise=standardise)
    module, _, function = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"embedding {name!r}: {err}") from err
    return factory(public_inputs, dims)
