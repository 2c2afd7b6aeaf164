"""Models: architecture sizes, the features/classifier contract, Opacus compatibility."""
from __future__ import annotations

import copy

import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn

from conclave.learning.models import REGISTRY, build_model

# (name, in_channels, input size, kwargs) small enough for a fast CPU test
CASES = [
    ("tutorial_cnn", 1, 28, {}),
    ("tutorial_cnn_tanh", 1, 28, {}),
    ("scatternet_cnn", 81, 7, {}),
    ("scatternet_cnn_wide", 81, 7, {}),
    ("scatternet_cnn_wide_relu", 81, 7, {}),
    ("digits_cnn", 1, 8, {}),
    ("digits_cnn_wide", 1, 8, {}),
    ("gn_cnn", 3, 32, {}),
    ("gn_resnet18", 3, 32, {"width": 0.25}),
]


def conv_params(c_in: int, c_out: int, k: int) -> int:
    return c_out * c_in * k * k + c_out


def linear_params(d_in: int, d_out: int) -> int:
    return d_in * d_out + d_out


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tutorial_cnn_matches_the_tf_privacy_architecture():
    # 28 → conv 8×8/2 pad 3 → 14 → pool 2/1 → 13 → conv 4×4/2 → 5 → pool 2/1 → 4; 32·4·4 = 512
    expected = conv_params(1, 16, 8) + conv_params(16, 32, 4) + linear_params(512, 32) + linear_params(32, 10)
    model = build_model("tutorial_cnn", num_classes=10)
    assert count(model) == expected == 26010
    assert model.features(torch.zeros(3, 1, 28, 28)).shape == (3, 32)
    # other channel counts and sizes change only the layers that depend on them
    wide = build_model("tutorial_cnn", num_classes=100, in_channels=3, input_size=32)
    # 32 → 16 → 15 → 6 → 5; 32·5·5 = 800
    assert count(wide) == (conv_params(3, 16, 8) + conv_params(16, 32, 4)
                           + linear_params(800, 32) + linear_params(32, 100))


def test_tutorial_cnn_tanh_differs_only_in_its_activations():
    relu, tanh = build_model("tutorial_cnn", 10, seed=3), build_model("tutorial_cnn_tanh", 10, seed=3)
    assert [type(m) for m in tanh.modules() if isinstance(m, (nn.ReLU, nn.Tanh))] == [nn.Tanh] * 3
    assert not any(isinstance(m, nn.ReLU) for m in tanh.modules())
    for (name, a), (_, b) in zip(relu.state_dict().items(), tanh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # same layers, same initial weights for the same seed
    with pytest.raises(ValueError, match="activation"):
        build_model("tutorial_cnn", 10, activation="gelu")


def test_scatternet_cnn_size_and_input_size_reaching_only_the_factories_that_take_it():
    # GroupNorm without affine weights: 81·32·9+32, 32·32·9+32, (32·3·3)·32+32, 32·10+10
    expected = conv_params(81, 32, 3) + conv_params(32, 32, 3) + linear_params(288, 32) + linear_params(32, 10)
    assert count(build_model("scatternet_cnn", 10, in_channels=81)) == expected == 42186
    cifar = build_model("scatternet_cnn", 10, in_channels=243, input_size=8)  # 3×32×32 images
    assert cifar(torch.zeros(2, 243, 8, 8)).shape == (2, 10)
    assert build_model("gn_cnn", 10, in_channels=3, input_size=32)(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_scatternet_cnn_wide_relu_differs_from_the_wide_one_only_in_its_activations():
    tanh, relu = build_model("scatternet_cnn_wide", 10, seed=3), build_model("scatternet_cnn_wide_relu", 10, seed=3)
    assert [type(m) for m in relu.modules() if isinstance(m, (nn.ReLU, nn.Tanh))] == [nn.ReLU] * 3
    for (name, a), (_, b) in zip(tanh.state_dict().items(), relu.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="activation"):
        build_model("scatternet_cnn", 10, activation="gelu")


def test_digits_cnn_size():
    expected = conv_params(1, 16, 3) + conv_params(16, 32, 3) + linear_params(32 * 4 * 4, 64) + linear_params(64, 10)
    assert count(build_model("digits_cnn", num_classes=10)) == expected == 38282
    wide = conv_params(1, 32, 3) + conv_params(32, 64, 3) + linear_params(64 * 4 * 4, 128) + linear_params(128, 10)
    assert count(build_model("digits_cnn_wide", num_classes=10)) == wide == 151306


@pytest.mark.parametrize("name, channels, size, kwargs", CASES)
def test_features_classifier_contract_and_opacus(name, channels, size, kwargs):
    model = build_model(name, num_classes=7, in_channels=channels, seed=0, **kwargs)
    x = torch.rand(4, channels, size, size)
    assert isinstance(model.classifier, nn.Linear) and model.classifier.out_features == 7
    last_linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert last_linear is model.classifier
    assert ModuleValidator.validate(model, strict=True) == []  # Opacus validates in train mode
    model.eval()
    assert torch.allclose(model(x), model.classifier(model.features(x).flatten(1)))
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert not any(getattr(m, "inplace", False) for m in model.modules())


# Opacus's hooks warn whenever the inputs themselves need no gradient — always the case here.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("name, channels, size", [("tutorial_cnn", 1, 28), ("digits_cnn", 1, 8), ("scatternet_cnn", 81, 7)])
def test_opacus_per_example_gradients_match_one_at_a_time(name, channels, size):
    """Opacus's per-example gradients for our CNNs equal those of separate backward passes."""
    model = build_model(name, num_classes=10, in_channels=channels, seed=1)
    reference = copy.deepcopy(model)  # same weights, no Opacus hooks
    x, y = torch.rand(3, channels, size, size), torch.tensor([1, 4, 9])
    wrapped = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
    per_example = [p.grad_sample for p in model.parameters()]
    for i in range(3):
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for sample, p in zip(per_example, reference.parameters()):
            assert torch.allclose(sample[i], p.grad, atol=1e-5)


def test_seeded_build_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("tutorial_cnn", 10, seed=4)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model("tutorial_cnn", 10, seed=4)
    c = build_model("tutorial_cnn", 10, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_registry_names_and_unknown_model():
    assert {"tutorial_cnn", "digits_cnn", "gn_resnet18", "gn_cnn"} <= set(REGISTRY)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg", 10)
    with pytest.raises(ValueError, match="at least 16"):
        build_model("tutorial_cnn", 10, input_size=8)


@pytest.mark.parametrize("kernel, stride, shape", [(2, 1, (3, 16, 14, 14)), (2, 2, (2, 32, 8, 8)),
                                                   (3, 2, (2, 4, 9, 7)), (2, 2, (1, 2, 5, 5))])
def test_index_free_max_pool_equals_torch_and_keeps_the_training_path(kernel, stride, shape):
    from conclave.learning.models.pooling import MaxPool2d

    x = torch.randn(*shape)
    x[0, 0, :2, :2] = 1.5  # ties inside a window
    pool = MaxPool2d(kernel, stride)
    reference = nn.functional.max_pool2d(x, kernel, stride)
    with torch.no_grad():
        assert torch.equal(pool(x), reference)
    # with gradients it is torch's layer: the same gradient, the whole window's max gets it
    x.requires_grad_(True)
    pool(x).sum().backward()
    expected = torch.autograd.grad(nn.functional.max_pool2d(x, kernel, stride).sum(), x)[0]
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("name, channels, size, kwargs", CASES)
def test_inference_votes_equal_torch_max_pool(name, channels, size, kwargs):
    """The index-free pooling changes no prediction: the same model with torch's own pooling
    layers gives bit-identical logits."""
    from conclave.learning.models import pooling

    model = build_model(name, num_classes=10, in_channels=channels, seed=3, input_size=size, **kwargs).eval()
    reference = copy.deepcopy(model)
    for parent in reference.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, pooling.MaxPool2d):
                setattr(parent, child_name, nn.MaxPool2d(child.kernel_size, child.stride))
    x = torch.rand(17, channels, size, size)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_table_models_standardise_with_the_given_public_statistics_and_train_under_dp_sgd():
    import numpy as np

    from conclave.learning.data.schema import Standardiser

    mean, scale = np.array([10.0, -2.0, 0.0], np.float32), np.array([2.0, 0.5, 1.0], np.float32)
    model = build_model("logistic_regression", 3, input_shape=(3,), standardiser=Standardiser(mean, scale), seed=0)
    assert torch.allclose(model.features(torch.tensor([[12.0, -2.5, 4.0]])), torch.tensor([[1.0, -1.0, 4.0]]))
    assert count(model) == linear_params(3, 3)  # the standardiser holds buffers, not parameters
    mlp = build_model("mlp", 2, input_shape=(3,), seed=0)
    assert count(mlp) == linear_params(3, 64) + linear_params(64, 64) + linear_params(64, 2)
    assert ModuleValidator.validate(mlp, strict=False) == []
    GradSampleModule(mlp)(torch.zeros(4, 3)).sum().backward()  # per-sample gradients: DP-SGD can train it
    with pytest.raises(ValueError, match=r"table models take rows \[n, d\]"):
        build_model("mlp", 2, input_shape=(1, 8, 8))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_quadratic_model_is_logistic_regression_on_the_clamped_columns_and_their_products():
    from conclave.learning.models.table import QUADRATIC_CLAMP, quadratic_features

    model = build_model("quadratic", 3, input_shape=(2,), seed=0)
    features = model.features(torch.tensor([[1.0, -2.0], [100.0, 0.5]]))  # no standardiser: the values as they are
    half = 2 ** -0.5
    assert torch.allclose(features, torch.tensor([[1.0, -2.0, half, -2 * half, 4 * half],
                                                  [QUADRATIC_CLAMP, 0.5, 16 * half, 2 * half, 0.25 * half]]))
    assert quadratic_features(15) == 135 and count(build_model("quadratic", 6, input_shape=(15,))) == 6 * 136
    assert not model.classifier.weight.any()  # convex: it starts at zero
    assert ModuleValidator.validate(model, strict=True) == []
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.classifier.weight.normal_()
    model.load_state_dict(reference.state_dict())
    x, y = torch.randn(3, 2) * 3, torch.tensor([0, 2, 1])
    wrapped = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
    for i in range(3):  # Opacus's per-example gradients are those of separate backward passes
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad_sample[i], q.grad, atol=1e-5)


def test_a_users_model_by_import_path_gets_the_same_arguments():
    model = build_model("conclave.learning.models.table:logistic_regression", 4, input_shape=(5,), seed=1)
    assert model(torch.zeros(2, 5)).shape == (2, 4)
    with pytest.raises(ValueError, match="cannot be imported here"):
        build_model("no_such_package.models:build", 2, input_shape=(5,))
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        build_model("resnet", 2)


@pytest.mark.parametrize("name, shape", [("tutorial_cnn", (1, 28, 28)), ("tutorial_cnn_tanh", (1, 28, 28)),
                                         ("digits_cnn", (1, 8, 8))])
def test_stacked_ensemble_predicts_what_each_model_predicts(name, shape):
    """Seven models (a block of 4 and a partial block of 3) on 50 inputs in chunks of 16 (a
    partial chunk too) predict through the stacked network exactly what each predicts alone."""
    import numpy as np

    from conclave.learning.models.ensemble import StackedEnsemble
    from conclave.learning.training import predict

    models = [build_model(name, 10, input_shape=shape, seed=i).eval() for i in range(7)]
    x = np.random.default_rng(0).normal(0, 3, (50, *shape)).astype(np.float32)
    alone = np.stack([predict(model, x) for model in models])
    assert len(np.unique(alone)) >= 3  # the models disagree, so a mix-up of teachers would show
    stacked = StackedEnsemble.of(models, block=4, chunk=16)
    assert stacked is not None
    np.testing.assert_array_equal(stacked.predict(x), alone)
    # Small batches run in wider blocks (all 7 for one input, 4·block for a few): the same classes.
    np.testing.assert_array_equal(stacked.predict(x[:1]), alone[:, :1])
    np.testing.assert_array_equal(stacked.predict(x[:5]), alone[:, :5])


def test_models_the_stacked_ensemble_cannot_run_are_left_to_the_caller():
    from conclave.learning.models.ensemble import StackedEnsemble, stackable

    assert not stackable([build_model("gn_cnn", 10, 3, seed=0, input_size=32)])  # GroupNorm
    assert not stackable([build_model("mlp", 10, input_shape=(5,), seed=0)])  # the standardising layer
    mixed = [build_model("tutorial_cnn", 10, seed=0), build_model("tutorial_cnn_tanh", 10, seed=1)]
    assert StackedEnsemble.of(mixed) is None
    with pytest.raises(ValueError, match="cannot be stacked"):
        StackedEnsemble(mixed)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_a_standardisers_keep_mask_makes_the_output_independent_of_dropped_columns():
    import numpy as np

    from conclave.learning.data.schema import Standardiser
    from conclave.learning.models.table import kept_columns

    keep = np.array([True, False, True, False])
    standardiser = Standardiser(np.ones(4, np.float32), np.full(4, 2.0, np.float32)).keeping(keep)
    model = build_model("quadratic", 3, input_shape=(4,), standardiser=standardiser, seed=0)
    nn.init.normal_(model.classifier.weight)  # every weight non-zero, those of dropped columns too
    x = torch.randn(5, 4)
    changed = x.clone()
    changed[:, ~torch.from_numpy(keep)] = torch.tensor([1e6, float("nan")])  # a dropped value reads as exactly 0
    with torch.no_grad():
        assert torch.equal(model(x), model(changed))
    sample = GradSampleModule(model)  # a dropped column's weights (its own and every product's) get exactly 0
    sample(x).sum().backward()
    dropped = model.features(x).abs().sum(dim=0) == 0
    assert dropped.sum() == 2 + 7  # two columns, and the 7 of 10 products with either
    assert torch.all(model.classifier.weight.grad_sample[:, :, dropped] == 0)
    assert torch.equal(model.state_dict()["features.0.keep"], torch.from_numpy(keep))  # a checkpoint carries it
    plain = build_model("quadratic", 3, input_shape=(4,), seed=0)  # no mask: every column, bit for bit
    assert plain.state_dict()["features.0.keep"].all()

    weight = np.array([[3.0, 0.1, -1.0, 0.0], [4.0, 0.0, 1.0, 0.3]])  # column norms 5, 0.1, 1.41, 0.3
    assert kept_columns(weight, 0.25).tolist() == [True, False, True, False]
    assert kept_columns(weight, 1.0).tolist() == [True, False, False, False]
    assert kept_columns(np.zeros((2, 3)), 0.35).all()  # nothing learnt: nothing dropped
    with pytest.raises(ValueError, match="share in"):
        kept_columns(weight, 0.0)
    with pytest.raises(ValueError, match="keep must be one bool per column"):
        Standardiser(np.zeros(2, np.float32), np.ones(2, np.float32), np.array([False, False]))
