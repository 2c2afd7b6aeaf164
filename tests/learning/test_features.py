"""Fixed feature representations: ScatterNet coefficients, computed one image at a time."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conclave.learning.data import Dataset, load_digits
from conclave.learning.data.features import apply_features, features_of, scattering
from conclave.learning.models import build_model


def images(n: int, channels: int, side: int, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset(rng.random((n, channels, side, side), dtype=np.float32), rng.integers(10, size=n), 10, "random")


@pytest.mark.parametrize(("channels", "side", "expected"), [(1, 28, (81, 7, 7)), (3, 32, (243, 8, 8)), (1, 8, (81, 2, 2))])
def test_scattering_shapes_81_maps_per_channel_at_a_quarter_of_the_side(channels, side, expected):
    data = images(3, channels, side)
    features = scattering(data)
    assert features.x.shape == (3, *expected) and features.x.dtype == np.float32
    assert np.array_equal(features.y, data.y) and features.name == "random/scattering"


def test_each_image_is_transformed_alone_so_the_transform_costs_no_privacy():
    # No statistic across examples: an image's features do not depend on its batch-mates.
    data = images(7, 1, 28)
    together = scattering(data, batch_size=7).x
    alone = np.concatenate([scattering(data.subset([i]), batch_size=1).x for i in range(7)])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-6)
    changed = data.subset(np.arange(7))
    changed.x[0] = 1.0 - changed.x[0]  # another first image leaves the others' features alone
    np.testing.assert_allclose(scattering(changed).x[1:], together[1:], rtol=1e-5, atol=1e-6)


def test_a_constant_image_has_only_its_low_pass_coefficient():
    # Morlet wavelets have zero mean, so every wavelet path of a constant image vanishes and the
    # order-0 map (a normalised Gaussian average) equals the constant.
    flat = Dataset(np.full((1, 1, 28, 28), 0.6, dtype=np.float32), np.zeros(1, dtype=np.int64), 10, "flat")
    coefficients = scattering(flat).x[0]
    np.testing.assert_allclose(coefficients[0], 0.6, rtol=1e-4)
    assert np.abs(coefficients[1:]).max() < 1e-4


def test_features_keep_the_layout_but_not_the_pixel_range():
    # Scattering values are not pixels: FFT rounding leaves tiny negatives, wavelet moduli
    # need not stay below 1. A features dataset says what it holds and needs finite values.
    features = scattering(images(4, 1, 28))
    assert features.features == "scattering" and features.subset([2, 0]).features == "scattering"
    shifted = features.x - 0.5
    assert Dataset(shifted, features.y, 10, "shifted", features="scattering").x.min() < 0
    with pytest.raises(ValueError, match="pixel values must be finite and in \\[0, 1\\]"):
        Dataset(shifted, features.y, 10, "shifted")
    shifted[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="scattering features must be finite"):
        Dataset(shifted, features.y, 10, "nan", features="scattering")
    with pytest.raises(ValueError, match="already holds scattering features"):
        scattering(features)


def test_bad_requests_are_refused_by_name():
    with pytest.raises(ValueError, match="divisible by 4"):
        scattering(images(2, 1, 30))
    with pytest.raises(ValueError, match="unknown feature representation 'sift'"):
        apply_features(images(2, 1, 28), "sift")
    with pytest.raises(ValueError, match="unknown feature representation 'sift'"):
        features_of(images(2, 1, 28).x, "sift")
    with pytest.raises(ValueError, match="HOG needs sides divisible by 4"):
        features_of(images(2, 1, 30).x, "hog")
    data = images(2, 1, 28)
    assert apply_features(data, None) is data and features_of(data.x, None) is data.x
    # unlabelled queries (what teachers vote on) get exactly the features a dataset gets
    np.testing.assert_array_equal(features_of(data.x, "scattering"), apply_features(data, "scattering").x)


def test_scatternet_cnn_learns_digits_from_their_scattering():
    train, test = load_digits()
    train_f, test_f = scattering(train), scattering(test)
    model = build_model("scatternet_cnn", 10, in_channels=81, seed=0, input_size=2)
    assert model.features(torch.from_numpy(test_f.x[:5])).shape == (5, 32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = torch.from_numpy(train_f.x), torch.from_numpy(train_f.y)
    for _ in range(30):
        for start in range(0, len(x), 64):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[start:start + 64]), y[start:start + 64]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(test_f.x)).argmax(1) == torch.from_numpy(test_f.y)).float().mean())
    assert accuracy > 0.9  # chance is 0.1


def test_hog_puts_an_edge_in_its_orientation_bin_and_keeps_blocks_normalised():
    """A horizontal step edge has vertical gradients (π/2: all in the bin centred there, 4 of 9), a
    vertical one horizontal gradients (orientation 0: halfway between the centres of bins 8 and 0,
    shared equally); every block is L2-Hys normalised."""
    from conclave.learning.data.features import HOG_BINS, apply_features, features_of

    vertical = np.zeros((1, 1, 28, 28), dtype=np.float32)
    vertical[..., 14:] = 1.0
    horizontal = np.ascontiguousarray(vertical.transpose(0, 1, 3, 2))
    for image, expected in ((vertical, {0: 0.5, 8: 0.5}), (horizontal, {4: 1.0})):
        blocks = features_of(image, "hog")
        assert blocks.shape == (1, 4 * HOG_BINS, 6, 6)
        energy = blocks.reshape(HOG_BINS, 4, 6, 6).sum(axis=(1, 2, 3))  # unfold: (bin, cell of the block)
        assert {b: round(float(energy[b] / energy.sum()), 3) for b in np.flatnonzero(energy > 1e-3 * energy.sum())} == expected
    norms = np.linalg.norm(features_of(np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32), "hog"), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-3)
    data = Dataset(vertical.repeat(2, axis=0), np.array([0, 1]), 2, "edges")
    assert apply_features(data, "hog").features == "hog"
