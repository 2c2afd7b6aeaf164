"""``conclave.registry``: one registry type behind models, data formats, selection strategies,
pipelines and commands: lazy, one line per entry, one-line errors naming the known names."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from conclave.cluster.cli import COMMANDS
from conclave.cluster.pipelines import PIPELINES, Pipeline
from conclave.learning.data.sources import FORMATS
from conclave.learning.models import REGISTRY
from conclave.learning.selection import STRATEGIES
from conclave.registry import MissingAttribute, Registry, UnknownName, imported


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A module of the user's, on the path but not imported yet; returns its name."""
    name = f"registry_user_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def build():\n    return 'built'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_registry_imports_its_entry_only_when_loaded(user_module):
    things: Registry[object] = Registry("thing", {"b": f"{user_module}:build", "a": user_module})
    assert user_module not in sys.modules
    assert things.names == ("a", "b") and "a" in things and "c" not in things and len(things) == 2
    assert things.path("b") == f"{user_module}:build" and dict(things)["a"] == user_module
    assert things.load("b")() == "built"
    assert things.load("a") is sys.modules[user_module]  # a bare "module" path is the module


def test_an_unknown_name_is_one_line_naming_the_known_ones():
    things: Registry[object] = Registry("thing", {"b": "json:dumps", "a": "json:loads"})
    for look_up in (things.load, things.path, things.__getitem__, things.about):
        with pytest.raises(UnknownName) as caught:
            look_up("c")
        assert str(caught.value) == "unknown thing 'c'; known: a, b"
        assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)
    assert things.get("c") is None  # still a mapping


def test_a_missing_attribute_is_told_apart_from_a_failing_import(user_module):
    with pytest.raises(MissingAttribute, match=rf"^module '{user_module}' \(.*\.py\) has no 'nothing'$") as caught:
        imported(f"{user_module}:nothing")
    assert caught.value.name == "nothing" and caught.value.obj is sys.modules[user_module]
    with pytest.raises(ModuleNotFoundError):
        imported("no_such_module_anywhere:build")


def test_descriptions_are_read_without_importing(user_module):
    things: Registry[object] = Registry.described("thing", {"a": (user_module, "the first thing")})
    assert things.about("a") == "the first thing" and user_module not in sys.modules
    assert Registry("thing", {"a": user_module}).about("a") == ""
    with pytest.raises(ValueError, match=r"descriptions of unregistered names \['b'\]"):
        Registry("thing", {"a": user_module}, about={"b": "no such thing"})


def test_every_registered_entry_of_the_project_loads():
    for kind in (REGISTRY, FORMATS, STRATEGIES):
        assert all(callable(kind.load(name)) for name in kind), kind.kind
    for name in PIPELINES:
        pipeline = PIPELINES.load(name)
        assert issubclass(pipeline, Pipeline) and pipeline.name == name, name
    for name in COMMANDS:
        module = COMMANDS.load(name)
        assert callable(module.add_arguments) and callable(module.main) and COMMANDS.about(name), name


def test_the_cli_and_pipeline_registries_import_neither_torch_nor_ray():
    """``conclave plan`` and ``conclave analyze`` start without them: the registries hold strings."""
    probe = ("import json, sys\n"
             "import conclave.cluster.cli, conclave.cluster.pipelines, conclave.learning.selection\n"
             "print(json.dumps(sorted(m for m in ('torch', 'ray') if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
