"""Named embeddings are registered classes that say what they are: a config's name is checked
against the registry, fitted by its class, and a class that does not describe itself is refused."""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from conclave.learning.embeddings import (EMBEDDINGS, Flatten, NamedEmbedding, PublicPCA, StandardisedPCA,
                                          check_embedding, fit_embedding, register)


def test_each_registered_name_is_fitted_by_its_class_on_the_public_pool_alone():
    public = np.random.default_rng(0).normal(size=(40, 3, 4)).astype(np.float32)
    for name in ("flatten", "pca", "standardised-pca"):  # the feature-based ones need images
        embedding = fit_embedding(name, public, 5)
        assert type(embedding) is EMBEDDINGS[name] and EMBEDDINGS[name].about
        assert embedding(public[:7]).shape == (7, 12 if name == "flatten" else 5)
    assert isinstance(fit_embedding("pca", public, 5), PublicPCA) and StandardisedPCA.standardised
    with pytest.raises(ValueError, match=r"knn.embedding must be one of \['flatten', 'pca', 'standardised-pca', "
                                         r"'scattering-pca', 'hog-pca'\], 'network:PATH'"):
        check_embedding("umap", "knn.embedding")


class Nameless(Flatten):
    name: ClassVar[str] = "a:b"


class Silent(Flatten):
    name: ClassVar[str] = "silent"
    about: ClassVar[str] = ""


@pytest.mark.parametrize("cls, problem", [(NamedEmbedding, "not a concrete NamedEmbedding"),
                                          (Nameless, "is not a new name without ':'"),
                                          (Silent, "it says nothing about itself")])
def test_a_class_that_does_not_describe_itself_is_refused(cls, problem):
    known = dict(EMBEDDINGS)
    with pytest.raises(TypeError, match=problem):
        register(cls)
    assert EMBEDDINGS == known


def _alone_and_among_others(embedding, inputs):
    together = embedding.records(inputs)
    shifted = embedding.records(np.concatenate([inputs[:3], inputs]))[3:]  # every record 3 rows down
    alone = np.concatenate([embedding.records(inputs[i:i + 1]) for i in range(len(inputs))])
    return together, shifted, alone


@pytest.mark.parametrize("name", ["flatten", "pca", "standardised-pca", "hog-pca", "scattering-pca"])
def test_a_records_embedding_has_the_same_bits_alone_as_among_others(name):
    """The one-record lemmas of kNN and cluster votes need each record's vector to be a function of
    that record alone (a matrix product rounds a row by its neighbours)."""
    images = np.random.default_rng(1).random((60, 1, 16, 16)).astype(np.float32)
    embedding = fit_embedding(name, images, 6)
    together, shifted, alone = _alone_and_among_others(embedding, images[:25])
    assert (together == shifted).all() and (together == alone).all()
    assert np.allclose(together, embedding(images[:25]), atol=1e-4)  # the queries' fast path: the same map


def test_a_networks_and_a_users_embedding_of_records_go_one_record_at_a_time():
    from conclave.learning.embeddings import NetworkEmbedding, UserEmbedding
    from conclave.learning.models import build_model

    network = build_model("tutorial_cnn", 10, input_shape=(1, 28, 28))
    state = {key: value.detach().numpy() for key, value in network.state_dict().items()}
    embedding = NetworkEmbedding("tutorial_cnn", 10, (1, 28, 28), None, state)
    images = np.random.default_rng(2).random((20, 1, 28, 28)).astype(np.float32)
    together, shifted, alone = _alone_and_among_others(embedding, images)
    assert (together == shifted).all() and (together == alone).all()
    calls = []
    user = UserEmbedding(lambda x: calls.append(len(x)) or x.reshape(len(x), -1))
    assert user.records(images[:4]).shape == (4, 784) and calls == [1, 1, 1, 1]
