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
