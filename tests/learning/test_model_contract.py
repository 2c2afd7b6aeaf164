"""The model contract (learning/models/contract.py): what a factory is called with, and the
driver's one-line check of a user's factory before anything runs."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from conclave.learning.data.schema import Standardiser
from conclave.learning.models import ModelContractError, build_model, check_model, user_source
from tests.user_model_sources import FACTORIES

# A user's package: factories that meet the contract and some that do not.
MODELS = FACTORIES + '''
def bare(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


def batch_norm(num_classes, input_shape):
    return nn.Sequential(nn.BatchNorm1d(input_shape[0]), nn.Linear(input_shape[0], num_classes))


def not_a_module(num_classes, input_shape):
    return "a model"


def fails(num_classes, input_shape):
    raise RuntimeError("out of ideas")


def standardised(num_classes, input_shape, standardiser):
    assert standardiser is not None
    return Rows(input_shape[0], num_classes)
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``<name>.models`` written under ``tmp_path`` and importable from it, as a package in a
    user's working directory is (a unique name per test: imported modules are cached)."""
    name = f"userpkg_{tmp_path.name.replace('-', '_').lower()}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "models.py").write_text(MODELS)
    (tmp_path / name / "broken.py").write_text("import not_an_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_table_factory_takes_only_what_it_declares(user_package):
    model = build_model(f"{user_package}.models:table", 3, input_shape=(5,), seed=0)  # no in_channels
    assert model(torch.zeros(4, 5)).shape == (4, 3)
    check_model(f"{user_package}.models:table", 3, (5,), parts={"features": "x", "classifier": "y"}, dp_sgd=True)
    statistics = Standardiser(np.zeros(5), np.ones(5))
    check_model(f"{user_package}.models:standardised", 3, (5,), standardiser=statistics)


def test_an_image_factory_gets_channels_and_side_from_the_shape(user_package):
    check_model(f"{user_package}.models:image", 10, (1, 8, 8), parts={"features": "x", "classifier": "y"},
                dp_sgd=True)
    assert build_model(f"{user_package}.models:image", 10, input_shape=(3, 6, 6))(torch.zeros(2, 3, 6, 6)).shape == (2, 10)


@pytest.mark.parametrize("factory, shape, options, message", [
    ("needs_hidden", (5,), {},
     r"^model '{p}.models:needs_hidden' cannot be called as the contract calls it \(missing a required argument: "
     r"'hidden'\): the contract passes num_classes and any of in_channels, input_size, input_shape, standardiser "
     r"the factory declares \(here: num_classes=3, input_shape=\(5,\)\); the factory declares num_classes, "
     r"input_shape, hidden$"),
    ("wrong_shape", (5,), {},
     r"^model '{p}.models:wrong_shape' maps a batch of shape \[2, 5\] to \[2, 4\]; the contract wants logits "
     r"\[batch, num_classes\] = \[2, 3\]$"),
    ("table", (1, 8, 8), {},
     r"^model '{p}.models:table': a forward pass on a float32 batch of shape \[2, 1, 8, 8\] failed: RuntimeError: "),
    ("bare", (5,), {"parts": {"classifier": "sparse fine-tuning replaces"}},
     r"^model '{p}.models:bare' has no .classifier \(the last nn.Linear\), which sparse fine-tuning replaces$"),
    ("bare", (5,), {"parts": {"features": "active learning embeds the pool with"}},
     r"^model '{p}.models:bare' has no .features\(x\) \(the activations before the logits\), which active "
     r"learning embeds the pool with$"),
    ("batch_norm", (5,), {"dp_sgd": True},
     r"^model '{p}.models:batch_norm' cannot be trained with DP-SGD \(Opacus\): "),
    ("not_a_module", (5,), {}, r"^model '{p}.models:not_a_module': the factory returned str, not a torch.nn.Module$"),
    ("fails", (5,), {},
     r"^model '{p}.models:fails': the factory failed with num_classes=3, input_shape=\(5,\): "
     r"RuntimeError: out of ideas$"),
    ("missing", (5,), {}, r"^model '{p}.models:missing': module '{p}.models' \(.*models.py\) has no factory 'missing'$"),
])
def test_a_factory_that_breaks_the_contract_is_one_line_naming_it(user_package, factory, shape, options, message):
    with pytest.raises(ModelContractError) as caught:
        check_model(f"{user_package}.models:{factory}", 3, shape, **options)
    assert "\n" not in str(caught.value)
    assert re.search(message.replace("{p}", user_package), str(caught.value)), str(caught.value)


def test_an_import_error_names_the_module_and_what_failed(user_package):
    with pytest.raises(ModelContractError, match=(
            rf"^model '{user_package}.broken:build' cannot be imported here: module '{user_package}.broken': "
            r"ModuleNotFoundError: No module named 'not_an_installed_dependency' \(modules are found from the "
            r"working directory and the installed packages\)$")):
        check_model(f"{user_package}.broken:build", 3, (5,))
    with pytest.raises(ModelContractError, match=r"^unknown model 'vgg'"):
        check_model("vgg", 3, (5,))


def test_user_source_is_what_ray_ships_a_folder_of_the_user_not_an_installed_package(user_package, tmp_path):
    assert user_source(f"{user_package}.models:table") == (tmp_path / user_package).resolve()
    (tmp_path / "single_file_models.py").write_text("def build(num_classes):\n    pass\n")
    assert user_source("single_file_models:build") == (tmp_path / "single_file_models.py").resolve()
    assert user_source("digits_cnn") is None  # built in
    assert user_source("conclave.learning.models.table:mlp") is None  # this package
    assert user_source("numpy.linalg:norm") is None  # installed in site-packages
    assert user_source("json:loads") is None  # the standard library
    assert user_source("no_such_package_anywhere:build") is None  # check_model says why


def test_a_factory_passed_as_a_callable_is_built_checked_and_named_by_its_import_path(user_package):
    import importlib

    table = importlib.import_module(f"{user_package}.models").table
    assert build_model(table, 3, input_shape=(5,), seed=0)(torch.zeros(2, 5)).shape == (2, 3)
    check_model(table, 3, (5,), parts={"features": "x", "classifier": "y"}, dp_sgd=True)
    fails = importlib.import_module(f"{user_package}.models").fails
    with pytest.raises(ModelContractError, match=rf"^model '{user_package}.models:fails': the factory failed"):
        check_model(fails, 3, (5,))
    assert user_source(table) == user_source(f"{user_package}.models:table")  # shipped as its path would be

    def in_the_script(num_classes, input_shape):  # a script's own function travels by value
        return torch.nn.Linear(input_shape[0], num_classes)

    in_the_script.__module__ = "__main__"
    assert user_source(in_the_script) is None and build_model(in_the_script, 2, input_shape=(5,)).out_features == 2
