"""FixMatch with ``balance_classes``: labelled images drawn class-balanced, so a class with one
released label is learned rather than drowned by one with dozens."""
from __future__ import annotations

import numpy as np

from conclave.learning.data import make_splits
from conclave.learning.models import build_model
from conclave.learning.semi_supervised import FixMatchConfig, fixmatch
from conclave.learning.training import predict


def test_a_class_with_one_label_is_learned_when_classes_are_balanced():
    splits = make_splits("digits", None, public_size=300, seed=0)
    train, test = splits.private, splits.test
    ones, sevens = np.flatnonzero(train.y == 1), np.flatnonzero(train.y == 7)
    labelled = np.concatenate([ones[:40], sevens[:1]])  # 40 answers of one class, 1 of the other
    pool = train.x[np.concatenate([ones, sevens])]
    held = np.isin(test.y, (1, 7))
    recalls = {}
    for balanced in (False, True):
        model = build_model("digits_cnn", 10, input_shape=train.x.shape[1:], seed=0)
        config = FixMatchConfig(epochs=15, batch_size=16, threshold=0.9, balance_classes=balanced)
        fixmatch(model, train.x[labelled], train.y[labelled], pool, config)
        guesses = predict(model, test.x[held])
        recalls[balanced] = float((guesses[test.y[held] == 7] == 7).mean())
    assert recalls[True] > recalls[False] + 0.2, recalls
