"""Fixed feature representations, computed by whoever holds the images, before training.

DP-SGD pays for every parameter it learns, and handcrafted features close much of the gap
(Tramèr & Boneh, ICLR 2021). A transform here has no fitted weights and maps each image alone,
so it costs no privacy: ScatterNet (``kymatio``, J = 2, L = 8: 81 maps per channel) and HOG
(Dalal & Triggs 2005, as Private-kNN embeds MNIST).
"""
from __future__ import annotations

import functools
import logging

import numpy as np
from tqdm import tqdm

from conclave.errors import InvalidValue
from conclave.learning.data.dataset import Dataset

log = logging.getLogger(__name__)

FEATURES = ("scattering", "hog")
HOG_CELL, HOG_BINS, HOG_BLOCK, HOG_CLIP = 4, 9, 2, 0.2


def _device():
    """Where the transforms compute: the GPU when this process sees one (each image is mapped
    alone, so the result does not depend on the batch or the device beyond float rounding)."""
    from conclave.learning.training import default_device

    return default_device()


@functools.lru_cache(maxsize=8)
def _scattering_transform(scales: int, shape: tuple[int, int], orientations: int):
    """The kymatio transform for one input shape, on ``_device()``, built once per process:
    building its filter bank costs about as much as transforming a batch of queries."""
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D

    return ScatteringTorch2D(J=scales, shape=shape, L=orientations).to(_device())


def scatter(images: np.ndarray, scales: int = 2, orientations: int = 8, batch_size: int = 1000,
            progress: bool = False, label: str = "images") -> np.ndarray:
    """Order-2 scattering coefficients of ``images`` (float32 ``[n, C, H, W]``):
    ``float32 [n, C·K, H/2^J, W/2^J]`` with K = 1 + J·L + L²·J(J−1)/2 (81 for J = 2, L = 8)."""
    import torch

    n, _, height, width = images.shape
    if n == 0:
        raise InvalidValue(f"{label}: no images to transform")
    if height % 2**scales or width % 2**scales:
        raise InvalidValue(f"scattering with J={scales} needs sides divisible by {2**scales}, "
                         f"got {height}×{width} ({label})")
    transform = _scattering_transform(scales, (height, width), orientations)
    parts = []
    with torch.no_grad():
        for start in tqdm(range(0, n, batch_size), desc=f"scattering {label}", disable=not progress):
            chunk = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size], dtype=np.float32))
            coefficients = transform(chunk.to(_device()))  # [b, C, K, H', W']
            parts.append(coefficients.reshape(len(chunk), -1, *coefficients.shape[-2:]).cpu().numpy())
    return np.concatenate(parts).astype(np.float32, copy=False)


def scattering(dataset: Dataset, progress: bool = False, **options) -> Dataset:
    """``dataset``'s images as scattering coefficients (``scatter``), labels unchanged."""
    if dataset.features is not None:
        raise InvalidValue(f"{dataset.name} already holds {dataset.features} features, not images")
    x = scatter(dataset.x, progress=progress, label=dataset.name, **options)
    return Dataset(x, dataset.y, dataset.num_classes, f"{dataset.name}/scattering", features="scattering")


def hog_batch(batch):
    """HOG of a torch image batch ``[n, C, H, W]`` (channels averaged): ``[n, 36, H/4 − 1, W/4 − 1]``."""
    import math

    import torch
    import torch.nn.functional as F

    gray = batch.mean(dim=1)
    if gray.shape[-1] % HOG_CELL or gray.shape[-2] % HOG_CELL:
        raise InvalidValue(f"HOG needs sides divisible by {HOG_CELL}, got {tuple(gray.shape[-2:])}")
    gx, gy = torch.zeros_like(gray), torch.zeros_like(gray)
    gx[..., :, 1:-1] = gray[..., :, 2:] - gray[..., :, :-2]
    gy[..., 1:-1, :] = gray[..., 2:, :] - gray[..., :-2, :]
    magnitude = torch.sqrt(gx**2 + gy**2)
    position = torch.remainder(torch.atan2(gy, gx), math.pi) / (math.pi / HOG_BINS) - 0.5  # between bin centres
    lower = torch.floor(position)
    upper_weight = position - lower
    histogram = torch.zeros(gray.shape[0], HOG_BINS, *gray.shape[1:], dtype=gray.dtype, device=gray.device)
    for offset, weight in ((0, 1 - upper_weight), (1, upper_weight)):
        index = torch.remainder(lower + offset, HOG_BINS).long().unsqueeze(1)
        histogram.scatter_add_(1, index, (magnitude * weight).unsqueeze(1))
    cells = F.avg_pool2d(histogram, HOG_CELL) * HOG_CELL**2  # [n, bins, H/4, W/4]
    blocks = F.unfold(cells, HOG_BLOCK)  # [n, bins·4, (H/4 − 1)(W/4 − 1)]
    blocks = blocks / torch.sqrt((blocks**2).sum(dim=1, keepdim=True) + 1e-6)
    blocks = torch.clamp(blocks, max=HOG_CLIP)
    blocks = blocks / torch.sqrt((blocks**2).sum(dim=1, keepdim=True) + 1e-6)
    side = (gray.shape[-2] // HOG_CELL - HOG_BLOCK + 1, gray.shape[-1] // HOG_CELL - HOG_BLOCK + 1)
    return blocks.reshape(len(batch), -1, *side)


def hog(images: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """HOG of ``images`` (float32 ``[n, C, H, W]``): float32 ``[n, 36, H/4 − 1, W/4 − 1]``."""
    import torch

    with torch.no_grad():
        parts = [hog_batch(torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size], dtype=np.float32))
                           .to(_device())).cpu().numpy() for start in range(0, len(images), batch_size)]
    return np.concatenate(parts).astype(np.float32, copy=False)


def check_features(name: str | None, where: str = "features") -> None:
    """Refuse an unknown representation name, saying where it came from (e.g. a config key)."""
    if name is not None and name not in FEATURES:
        raise InvalidValue(f"unknown feature representation {name!r} for {where}; "
                         f"choose one of {list(FEATURES)} or null")


def apply_features(dataset: Dataset, name: str | None, progress: bool = False) -> Dataset:
    """``dataset`` in the representation ``name`` (``None``: the images themselves)."""
    check_features(name)
    if name is None:
        return dataset
    log.info("computing %s features of %s (%d examples)", name, dataset.name, len(dataset))
    if name == "hog":
        if dataset.features is not None:
            raise InvalidValue(f"{dataset.name} already holds {dataset.features} features, not images")
        return Dataset(hog(dataset.x), dataset.y, dataset.num_classes, f"{dataset.name}/hog", features="hog")
    return scattering(dataset, progress=progress)


def batch_transform(name: str | None, image_shape: tuple[int, int]):
    """The representation ``name`` as a function of a torch image batch ``[n, C, H, W]`` of
    side ``image_shape``, for code that augments images and then represents them."""
    check_features(name)
    if name is None:
        return lambda batch: batch
    transform = hog_batch if name == "hog" else _scattering_transform(2, tuple(image_shape), 8)

    def represent(batch):  # computed on _device(), returned where the batch came from
        coefficients = transform(batch.to(_device()))  # scattering: [n, C, K, H', W']
        return coefficients.reshape(len(batch), -1, *coefficients.shape[-2:]).to(batch.device)

    return represent


def features_of(images: np.ndarray, name: str | None) -> np.ndarray:
    """Unlabelled ``images`` (e.g. queries) in the representation ``name`` (``None``: as they are)."""
    check_features(name)
    if name is None:
        return images
    return hog(images) if name == "hog" else scatter(images)
