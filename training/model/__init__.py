"""The model: the scikit-learn-compatible estimator and its initialisation.

* ``estimator.py``: ``NCA`` (fit, transform, get/set_params; fitted attributes with a
  trailing underscore) (``tests/training/model/test_estimator.py``).
* ``fitting.py``: ``StagedFit``, the stages of one fit (the first optimisation, the judged
  exact finish) and what they share (the objective, the monitor, the judge).
* ``preparation.py``, ``plan.py``, ``parameters.py``: what a fit starts from, every "auto"
  resolved, the parameters' constraints.
* ``initialization.py``: the initial map: auto (LDA, else PCA, else identity), pca, lda,
  identity, random, a matrix or a previous artifact (``tests/training/model/test_estimator.py``,
  ``test_helpers.py``).
"""
