"""Evaluation: what the report states, measured with the service's own kNN rule.

* ``evaluate.py``: kNN accuracy for k in 1, 3, ..., 15 on validation and test, with
  ``service.core.knn`` (``tests/integration/test_offline_online.py``).
* ``baselines.py``: Euclidean, whitening, PCA, LDA and RCA maps
  (``tests/training/evaluation/test_baselines.py``).
* ``calibration.py``: the outlier calibration (quantiles of held-out nearest distances)
  (``tests/training/evaluation/test_outliers.py``).
* ``report.py``: ``report.json`` and the plots next to the artifact.
"""
