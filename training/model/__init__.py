"""The model: the scikit-learn-compatible estimator and its initialisation.

* ``estimator.py``: ``NCA`` (fit, transform, get/set_params; fitted attributes with a
  trailing underscore) (``tests/training/model/test_estimator.py``).
* ``fitting.py``: the fit loop: the plan's stages (the first optimisation, the exact
  finish), one keep rule and the stop rules on held-out scores, ``StopReason``.
* ``preparation.py``, ``plan.py``, ``parameters.py``: what a fit starts from, every "auto"
  resolved, the parameters' constraints.
* ``initialization.py``: the initial map: auto (LDA, else PCA, else identity), pca, lda,
  identity, random, a matrix or a previous artifact, and the scale it starts at
  (``tests/training/model/test_estimator.py``, ``test_helpers.py``, ``test_init_scale.py``).
"""
