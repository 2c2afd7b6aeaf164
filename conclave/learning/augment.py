"""Image augmentations for semi-supervised training of the student (public data only).

FixMatch (Sohn et al., NeurIPS 2020) needs a *weak* view of each unlabelled image, whose
confident prediction becomes a pseudo-label, and a *strong* view the model must learn to
map to that label. For digits the natural transformations are small shifts, rotations and
scalings, plus occlusion (cutout) and noise for the strong view; no flips (a flipped 2 is
not a 2). Transformations scale with the image side, so the same settings serve 8×8 digits
and 28×28 MNIST. Everything works on torch batches ``[n, C, H, W]`` in [0, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class Augmentation:
    """A random affine warp (shift, rotation, scale), then cutout and noise; 0 turns a part off.

    ``shift`` is a fraction of the side; ``rotation`` in degrees; ``scale`` the largest
    relative zoom; ``cutout`` the side of the erased square as a fraction of the side."""

    shift: float = 0.0
    rotation: float = 0.0
    scale: float = 0.0
    cutout: float = 0.0
    noise: float = 0.0

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        n, _, height, width = images.shape
        out = images
        if self.shift or self.rotation or self.scale:
            out = _affine(out, self.shift, self.rotation, self.scale, generator)
        if self.cutout:
            out = _cutout(out, self.cutout, generator)
        if self.noise:
            out = out + self.noise * torch.randn(out.shape, generator=generator)
        return out.clamp(0.0, 1.0)


WEAK = Augmentation(shift=0.125)
STRONG = Augmentation(shift=0.2, rotation=20.0, scale=0.15, cutout=0.35, noise=0.1)


def _uniform(n: int, bound: float, generator: torch.Generator | None) -> torch.Tensor:
    return (torch.rand(n, generator=generator) * 2 - 1) * bound


def _affine(images: torch.Tensor, shift: float, rotation: float, scale: float,
            generator: torch.Generator | None) -> torch.Tensor:
    n = images.shape[0]
    angle = _uniform(n, math.radians(rotation), generator)
    zoom = 1 + _uniform(n, scale, generator)
    # affine_grid works in [-1, 1] coordinates: a shift of ``shift`` of the side is 2·shift there
    tx, ty = _uniform(n, 2 * shift, generator), _uniform(n, 2 * shift, generator)
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, padding_mode="zeros", align_corners=False)


def _cutout(images: torch.Tensor, fraction: float, generator: torch.Generator | None) -> torch.Tensor:
    n, _, height, width = images.shape
    size_h, size_w = max(1, round(fraction * height)), max(1, round(fraction * width))
    top = torch.randint(0, height - size_h + 1, (n,), generator=generator)
    left = torch.randint(0, width - size_w + 1, (n,), generator=generator)
    rows = torch.arange(height)[None, :, None]
    cols = torch.arange(width)[None, None, :]
    inside = ((rows >= top[:, None, None]) & (rows < top[:, None, None] + size_h)
              & (cols >= left[:, None, None]) & (cols < left[:, None, None] + size_w))
    return images * (~inside)[:, None].to(images.dtype)
