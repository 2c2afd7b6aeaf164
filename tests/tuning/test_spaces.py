"""Search spaces: YAML domains, the ε simplex, and dotted keys into a run config."""
from __future__ import annotations

import numpy as np
import pytest

from conclave.cluster.config import ConfigError
from conclave.tuning import spaces

SIMPLEX = {"allocation": {"simplex": {"keys": ["dpsgd.target_epsilon", "selection.epsilon_pca",
                                                "selection.epsilon_support"], "total": 3.0, "minimum": 0.1}}}


def test_simplex_points_sum_to_the_limit_and_respect_the_minimum():
    rng = np.random.default_rng(0)
    shares = []
    for _ in range(4000):
        params = {f"allocation[{i}]": float(u) for i, u in enumerate(rng.uniform(1e-12, 1.0, size=3))}
        values = spaces.overrides(SIMPLEX, params)
        point = [values["dpsgd.target_epsilon"], values["selection.epsilon_pca"], values["selection.epsilon_support"]]
        assert sum(point) == pytest.approx(3.0, abs=1e-12)
        assert min(point) >= 0.1 - 1e-12
        shares.append(point)
    shares = np.array(shares)
    # Uniform on the simplex {x ≥ 0.1, Σx = 3}: x_i − 0.1 = 2.7·Dirichlet(1,1,1)_i, whose marginal
    # is Beta(1, 2): mean 1/3, P[share < 1/2 of 2.7] = 1 − (1/2)² = 3/4.
    assert shares.mean(axis=0) == pytest.approx([1.0, 1.0, 1.0], abs=0.05)
    assert np.mean((shares[:, 0] - 0.1) / 2.7 < 0.5) == pytest.approx(0.75, abs=0.025)


def test_overrides_go_into_a_copy_of_the_base_config():
    base = {"pipeline": "teacher_student", "teachers": {"count": 10}, "mechanism": {"params": {"sigma1": 1.0}}}
    raw = spaces.apply(base, {"teachers.count": 20, "mechanism.params.sigma2": 3.0, "student.queries": 50})
    assert raw["teachers"]["count"] == 20
    assert raw["mechanism"]["params"] == {"sigma1": 1.0, "sigma2": 3.0}
    assert raw["student"] == {"queries": 50}
    assert base["teachers"]["count"] == 10 and "sigma2" not in base["mechanism"]["params"]
    with pytest.raises(ConfigError, match="not a section"):
        spaces.apply(base, {"teachers.count.value": 3})


def test_every_domain_becomes_a_tune_domain_and_a_preview_point():
    space = {"a": {"choice": [1, 2]}, "b": {"grid": [[1], [2]]}, "c": {"uniform": [0.5, 1.5]},
             "d": {"loguniform": [1e-3, 1e-1]}, "e": {"randint": [2, 9]}, **SIMPLEX}
    params = spaces.search_space(space)
    assert set(params) == {"a", "b", "c", "d", "e", "allocation[0]", "allocation[1]", "allocation[2]"}
    assert params["b"] == {"grid_search": [[1], [2]]}
    preview = spaces.preview(space)
    assert preview["a"] == 1 and preview["b"] == [1] and preview["e"] == 2
    assert preview["dpsgd.target_epsilon"] == pytest.approx(1.0)
    assert spaces.has_grid(space) and not spaces.has_grid(SIMPLEX)
    assert "selection.epsilon_support" in spaces.swept_keys(space) and "allocation" not in spaces.swept_keys(space)


@pytest.mark.parametrize("spec,message", [
    ({"between": [1, 2]}, "expected one of"),
    ({"uniform": [2, 1]}, "low < high"),
    ({"loguniform": [0, 1]}, "> 0"),
    ({"choice": []}, "non-empty list"),
    ({"simplex": {"keys": ["a", "b"], "total": 1.0, "minimum": 0.6}}, "minimum"),
])
def test_bad_domains_name_the_key(spec, message):
    with pytest.raises(ConfigError, match=message) as err:
        spaces.search_space({"teachers.count": spec})
    assert "space.teachers.count" in str(err.value)
