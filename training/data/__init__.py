"""Data for the training job.

* ``datasets.py``: built-in sets (scikit-learn's), ``.npz``, ``.npy`` pairs and CSV; the
  stratified train / validation / test split; the standardisation fitted on train only
  (``tests/training/test_helpers.py``, ``test_cli.py``).
"""
