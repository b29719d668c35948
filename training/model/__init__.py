"""The model: the scikit-learn-compatible estimator and its initialisation.

* ``estimator.py``: ``NCA`` (fit, transform, get/set_params; fitted attributes with a
  trailing underscore) (``tests/training/model/test_estimator.py``).
* ``initialization.py``: the initial map: auto (LDA, else PCA, else identity), pca, lda,
  identity, random, a matrix or a previous artifact (``tests/training/model/test_estimator.py``,
  ``test_helpers.py``).
"""
