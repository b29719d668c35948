"""USPS (the papers' digits), when ../shared/data/usps.npz is present. Slow: run with -m slow."""

from __future__ import annotations

import pytest
from sklearn.neighbors import KNeighborsClassifier

from training import NCA

pytestmark = pytest.mark.slow


def test_large_n_path_matches_full_batch_accuracy_on_usps(usps):
    X, y, X_test, y_test = usps
    kw = dict(n_components=32, random_state=0, max_iter=100)
    full = NCA(n_candidates=None, **kw).fit(X, y)
    large = NCA(n_candidates=32, **kw).fit(X, y)

    def accuracy(model):
        clf = KNeighborsClassifier(1).fit(model.transform(X), y)
        return clf.score(model.transform(X_test), y_test)

    full_acc, large_acc = accuracy(full), accuracy(large)
    assert full_acc > 0.93
    assert large_acc >= full_acc - 0.005
