"""Label propagation over the public pool: it recovers clusters' labels, stays within what it was
given, and its settings are checked when the config is built."""
from __future__ import annotations

import numpy as np
import pytest

from conclave.cluster.config import from_dict
from conclave.cluster.teaching.config import StudentConfig
from conclave.learning.label_propagation import NO_LABEL, LabelPropagationConfig, propagate


def blobs(centres: np.ndarray, each: int, spread: float = 0.3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``each`` points around every centre, shaped like images ``[n, 1, 2, d/2]``; their blob indices."""
    rng = np.random.default_rng(seed)
    points = np.concatenate([centre + spread * rng.standard_normal((each, len(centre))) for centre in centres])
    return points.reshape(len(points), 1, 2, -1).astype(np.float32), np.repeat(np.arange(len(centres)), each)


def test_one_label_per_cluster_labels_every_point_of_it():
    centres = 5.0 * np.eye(6)[:3]  # three clusters, well apart in 6 dimensions
    inputs, truth = blobs(centres, 20)
    answered = np.array([0, 20, 40])
    for components in (None, 4):
        spread = propagate(inputs, answered, truth[answered], 3,
                           LabelPropagationConfig(neighbours=5, components=components))
        assert (spread.labels == truth).all()
        assert (spread.confidence > 0.9).all()
        assert len(spread.confident(0.9)) == len(inputs)
    again = propagate(inputs, answered, truth[answered], 3, LabelPropagationConfig(neighbours=5, components=4))
    assert (again.labels == spread.labels).all() and (again.confidence == spread.confidence).all()  # deterministic


def test_the_graph_outvotes_a_wrong_label_and_leaves_unreached_points_unlabelled():
    inputs, truth = blobs(np.array([[0.0, 0, 0, 0], [10, 10, 10, 10], [-10, 10, -10, 10]]), 15)
    # Cluster 0: four right labels and one wrong; cluster 1: one label; cluster 2: none, and with
    # 3 neighbours no edge leaves a cluster, so nothing reaches it.
    answered = np.array([0, 1, 2, 3, 4, 15])
    released = np.array([0, 0, 0, 0, 1, 1])
    spread = propagate(inputs, answered, released, 3,
                       LabelPropagationConfig(neighbours=3, alpha=0.99, components=None))
    assert (spread.labels[:15] == 0).all()  # the wrongly labelled point included
    assert (spread.labels[15:30] == 1).all()
    assert (spread.labels[30:] == NO_LABEL).all() and (spread.confidence[30:] == 0).all()
    assert set(spread.confident(0.5)) <= set(range(30))


def test_propagation_rejects_labels_that_do_not_fit_the_pool():
    inputs, _ = blobs(np.zeros((1, 4)), 10)
    config = LabelPropagationConfig()
    with pytest.raises(ValueError, match="one label per answered index"):
        propagate(inputs, np.array([0, 1]), np.array([0]), 2, config)
    with pytest.raises(ValueError, match=r"labels in \[0, 2\)"):
        propagate(inputs, np.array([0]), np.array([2]), 2, config)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 10\)"):
        propagate(inputs, np.array([10]), np.array([0]), 2, config)


@pytest.mark.parametrize("bad, name", [
    ({"neighbours": 0}, "neighbours"), ({"alpha": 1.0}, "alpha"), ({"alpha": 0.0}, "alpha"),
    ({"components": 0}, "components"), ({"threshold": 0.0}, "threshold"), ({"threshold": 1.5}, "threshold"),
])
def test_the_config_rejects_bad_values_in_one_line(bad, name):
    with pytest.raises(ValueError, match=f"label_propagation.{name}") as err:
        from_dict(StudentConfig, {"label_propagation": bad})
    assert "\n" not in str(err.value)


def test_the_student_config_takes_propagation_with_fixmatch_but_not_with_self_training():
    both = from_dict(StudentConfig, {"label_propagation": {"neighbours": 7},
                                     "semi_supervised": {"epochs": 5}})
    assert both.label_propagation == LabelPropagationConfig(neighbours=7)
    assert from_dict(StudentConfig, {}).label_propagation is None  # off unless asked for
    with pytest.raises(ValueError, match="pseudo_label_threshold .* or label_propagation") as err:
        from_dict(StudentConfig, {"label_propagation": {}, "pseudo_label_threshold": 0.9})
    assert "\n" not in str(err.value)
