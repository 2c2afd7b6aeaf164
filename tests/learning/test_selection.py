"""Selection strategies on constructed pools, and the annotator that sells labels."""
from __future__ import annotations

import numpy as np
import pytest

from conclave.learning.annotation import CallableAnnotator, RevealingAnnotator, split_private_public
from conclave.learning.data import load_digits
from conclave.learning.embedding_stats import CentralSupport
from conclave.learning.selection import PublicPool, build_strategy
from conclave.learning.selection.entropy import logit_entropy
from conclave.learning.selection.margin import top_two_difference
from conclave.privacy.counts import LaplaceCounts
from conclave.privacy.noise import SECURE
from conclave.privacy.pca import AnalyzeGauss

CENTRES = np.eye(8)[:5] * 10.0  # five well-separated blobs in 8-D


def blobs(sizes, rng, spread=0.3):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    return CENTRES[labels] + spread * rng.normal(size=(len(labels), 8)), labels


def test_diverse_public_covers_every_cluster_where_uncertainty_alone_does_not():
    rng = np.random.default_rng(0)
    embeddings, blob = blobs([300, 20, 20, 20, 20], rng)
    logits = rng.normal(scale=0.1, size=(len(blob), 10))  # all about equally uncertain
    logits[blob == 0] *= 0.5  # the big blob slightly more so
    pool = PublicPool(logits, embeddings)
    diverse = build_strategy("diverse_public", components=4, n_each=2, uncertain_factor=40)
    chosen = diverse.select(pool, [10], np.random.default_rng(1))[10]
    assert len(set(chosen)) == 10
    assert np.bincount(blob[chosen], minlength=5).tolist() == [2, 2, 2, 2, 2]
    by_entropy = build_strategy("entropy").select(pool, [10], rng)[10]
    assert set(blob[by_entropy]) == {0}


def test_near_private_prefers_public_points_near_the_private_data():
    rng = np.random.default_rng(0)
    private, _ = blobs([200, 200, 0, 0, 0], rng)  # private data lives in blobs 0 and 1
    public, blob = blobs([50, 50, 50, 50, 0], rng)  # blobs 2 and 3 are out of domain
    public_logits = rng.normal(scale=0.3, size=(200, 10))
    public_logits[blob >= 2] *= 0.2  # ... and the model is MOST uncertain about them
    private_entropy = np.full(len(private), np.log(10))  # every private point votes
    charges = []
    # ε_support = 4 (noise scale 0.25): no out-of-domain point can outvote the ~4 votes of in-domain ones
    support = CentralSupport(private, private_entropy, AnalyzeGauss(1.0, 1e-5), LaplaceCounts(4.0),
                             charges.append, SECURE)
    near = build_strategy("near_private", support=support, components=4, uncertain_factor=10)
    chosen = near.select(PublicPool(public_logits, public), [20, 40], np.random.default_rng(2))
    assert set(blob[chosen[40]]) <= {0, 1} and {0, 1} <= set(blob[chosen[40]])
    np.testing.assert_array_equal(chosen[20], chosen[40][:20])  # one release serves every budget
    assert [c.label for c in charges] == ["dp-pca", "noisy-counts"]
    by_entropy = build_strategy("entropy").select(PublicPool(public_logits, public), [40], rng)[40]
    assert set(blob[by_entropy]) <= {2, 3}


def test_uncertainty_baselines_pick_what_they_promise():
    logits = np.array([[5.0, 0.0, 0.0], [1.0, 1.0, 1.0], [2.0, 1.9, -3.0], [3.0, 0.0, 0.0]])
    pool = PublicPool(logits, np.zeros((4, 2)))
    assert np.argmax(logit_entropy(logits)) == 1
    assert top_two_difference(logits).tolist() == pytest.approx([5.0, 0.0, 0.1, 3.0])
    assert build_strategy("entropy").select(pool, [2], None)[2].tolist() == [1, 2]
    assert build_strategy("margin").select(pool, [3], None)[3].tolist() == [1, 2, 3]
    picks = build_strategy("random").select(pool, [2, 4], np.random.default_rng(0))
    assert sorted(picks[4]) == [0, 1, 2, 3] and picks[2].tolist() == picks[4][:2].tolist()


def test_bad_budgets_and_names_are_refused():
    pool = PublicPool(np.zeros((5, 3)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match="budgets"):
        build_strategy("entropy").select(pool, [6], None)
    with pytest.raises(ValueError, match="unknown selection strategy"):
        build_strategy("nearest")
    with pytest.raises(ValueError, match="logits"):
        PublicPool(np.zeros((5, 3)), np.zeros((4, 2)))


def test_annotators_reveal_only_what_was_bought():
    labels = np.array([3, 1, 4, 1, 5])
    annotator = RevealingAnnotator(labels)
    assert annotator.label(np.array([4, 0])).tolist() == [5, 3]
    assert annotator.bought == 2
    with pytest.raises(ValueError, match="public pool"):
        annotator.label(np.array([5]))
    oracle = CallableAnnotator(np.arange(5.0), lambda x: (x * 2).astype(np.int64))
    assert oracle.label(np.array([1, 2])).tolist() == [2, 4] and oracle.bought == 2


def test_private_and_public_splits_are_disjoint_and_cover_the_training_set():
    train, _ = load_digits()
    private, public = split_private_public(train, 1000, seed=0)
    assert len(private) == 1000 and len(public) == len(train) - 1000
    rows = {row.tobytes() for row in private.x}
    assert sum(row.tobytes() in rows for row in public.x) <= 5  # digits holds a few duplicate images


def test_medoids_label_the_pool_by_their_own_cluster_or_by_a_weighted_vote_of_the_nearest():
    """Public-cluster votes' post-processing: one wrong medoid label among three or more in a blob
    is outvoted by its neighbours; with one medoid, each cluster takes its medoid's label."""
    from conclave.learning.selection.clusters import cluster_pool

    embedded, blob = blobs([60, 60, 60], np.random.default_rng(0))
    clusters = cluster_pool(embedded, 9, seed=0)
    truth = {int(m): int(blob[m]) for m in clusters.medoids}
    per_blob = np.bincount(blob[clusters.medoids], minlength=3)
    assert per_blob.min() >= 2 and per_blob.max() >= 3  # every blob has medoids, one has three or more
    crowded = int(per_blob.argmax())
    wrong = int(clusters.medoids[blob[clusters.medoids] == crowded][0])
    released = {**truth, wrong: (crowded + 1) % 3}
    own = clusters.spread(released)
    assert all(own[i] == released[int(clusters.medoids[c])] for i, c in enumerate(clusters.members))
    voted = clusters.spread(released, nearest=3, decay=0.8)  # 0.8 + 0.64 > 1: two right outvote one wrong
    assert voted == dict(enumerate(blob.tolist()))
    # an abstained medoid labels nothing, and its cluster is labelled by the answered ones
    assert clusters.spread({k: v for k, v in truth.items() if k != wrong}, nearest=2, decay=0.8) == \
        dict(enumerate(blob.tolist()))
    # equal weights, one each: the nearer medoid's label wins the tie
    nearest_only = clusters.spread(released, nearest=1)
    tied = clusters.spread(released, nearest=2, decay=1.0)
    assert tied[wrong] == (crowded + 1) % 3 and len(tied) == len(blob) and len(nearest_only) == len(blob)
    assert clusters.spread({}, nearest=3, decay=0.8) == {}
    # a margin leaves out the inputs whose vote is close: 1 against 0.8 + 0.64 leads by 0.44 / 2.44
    weights = 1 + 0.8 + 0.64
    assert voted[wrong] == blob[wrong] != tied[wrong]  # where the wrong medoid is nearest, the right label wins narrowly
    kept = clusters.spread(released, nearest=3, decay=0.8, margin=0.5 / weights)
    assert wrong not in kept and set(kept) < set(voted) and all(kept[i] == blob[i] for i in kept)
    assert clusters.spread(released, nearest=3, decay=0.8, margin=0.4 / weights)[wrong] == blob[wrong]


def test_spreading_over_nearest_medoids_is_checked_and_needs_public_cluster_votes():
    from conclave.cluster.teaching.config import StudentConfig, TeacherStudentConfig
    from conclave.learning.selection import QuerySelection

    for bad in ({"spread_medoids": 0}, {"spread_decay": 0.0}, {"spread_decay": 1.5}, {"spread_margin": 1.0}):
        with pytest.raises(ValueError, match=r"spread_medoids must be >= 1, spread_decay in \(0, 1\] and spread_margin"):
            QuerySelection(**bad)
    with pytest.raises(ValueError, match="spread_margin weighs the votes of several medoids"):
        QuerySelection(spread_margin=0.3)
    with pytest.raises(ValueError, match="spread_medoids spreads public-cluster votes' labels: it needs a clusters"):
        TeacherStudentConfig(student=StudentConfig(selection=QuerySelection(spread_medoids=5)))
