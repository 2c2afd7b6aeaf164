"""Test-time views: the prediction is the argmax of the softmax averaged over the image and its weak views."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conclave.learning.view_averaging import predict_with_views
from conclave.learning.training import predict


class CentreDetector(nn.Module):
    """Class 1 when the centre pixel is brighter than 0.5, else class 0 (confidently either way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centre = x[:, 0, 4, 4]
        return torch.stack([torch.zeros_like(centre), 40.0 * (centre - 0.5)], dim=1)


def _centre_dots(n: int) -> np.ndarray:
    images = np.zeros((n, 1, 8, 8), dtype=np.float32)
    images[:, 0, 4, 4] = 1.0
    return images


def test_no_views_is_the_plain_prediction():
    images = np.random.default_rng(0).random((50, 1, 8, 8)).astype(np.float32)
    model = CentreDetector()
    assert (predict_with_views(model, images, lambda batch: batch, 0, seed=1) == predict(model, images)).all()


def test_the_views_outvote_the_plain_image():
    """A weak view shifts the image by up to 1/8 of its side (one pixel here), which mostly moves the
    dot off the centre: the plain image says 1, most views say 0, so their average says 0."""
    images = _centre_dots(200)
    plain = predict_with_views(CentreDetector(), images, lambda batch: batch, 0, seed=1)
    averaged = predict_with_views(CentreDetector(), images, lambda batch: batch, 8, seed=1)
    assert (plain == 1).all()
    assert (averaged == 0).mean() > 0.9


def test_a_seed_repeats_its_views_and_a_negative_count_is_refused():
    images = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    linear = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    first = predict_with_views(linear, images, lambda batch: batch, 4, seed=3, batch_size=16)
    assert (first == predict_with_views(linear, images, lambda batch: batch, 4, seed=3, batch_size=16)).all()
    with pytest.raises(ValueError, match="test views"):
        predict_with_views(linear, images, lambda batch: batch, -1, seed=3)
