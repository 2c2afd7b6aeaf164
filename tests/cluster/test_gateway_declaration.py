"""The owner's own file for its gateway: loaded with relative paths from its folder, and refused in
one line naming the key when it is not one."""
from __future__ import annotations

import pytest
import yaml

from conclave.cluster.config import ConfigError
from conclave.cluster.gateway.declaration import load_declaration

OWNER = {"name": "hospital_a", "data": {"format": "npz", "path": "records.npz", "label": "y"}, "records": 200,
         "listen": "127.0.0.1:7000", "tls": {"certificate": "gateway.pem", "key": "gateway.key", "ca": "ca.pem"},
         "peers": ["hospital_b"]}


def _written(tmp_path, **changes):
    for name in ("gateway.pem", "gateway.key", "ca.pem"):
        (tmp_path / name).write_text("")
    path = tmp_path / "owner.yaml"
    path.write_text(yaml.safe_dump({**OWNER, **changes}))
    return path


def test_relative_paths_are_the_files_folder(tmp_path):
    declaration = load_declaration(_written(tmp_path))
    assert declaration.data.path == str(tmp_path / "records.npz")
    assert declaration.tls.ca == str(tmp_path / "ca.pem")
    assert declaration.host_port == ("127.0.0.1", 7000) and declaration.parties == {"hospital_a", "hospital_b"}
    assert declaration.ray.address == "local"


@pytest.mark.parametrize("changes, words", [
    ({"runtime_env": {"env_vars": {"HOME": "/tmp"}}}, "unknown key(s) ['runtime_env']"),
    ({"listen": "7000"}, "listen must be host:port"),
    ({"peers": ["hospital_a"]}, "peers must be distinct owners other than hospital_a"),
    ({"vote_sources": ["dpsgd"]}, "vote_sources ['dpsgd'] are not known"),
    ({"max_teachers": 201}, "max_teachers must be in [1, records]"),
    ({"max_epochs": 0}, "max_epochs must be >= 1"),
    ({"tls": {"certificate": "missing.pem", "key": "gateway.key", "ca": "ca.pem"}}, "tls.certificate: no such file"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, changes, words):
    with pytest.raises(ConfigError) as caught:
        load_declaration(_written(tmp_path, **changes))
    assert words in str(caught.value) and "\n" not in str(caught.value)
