"""Data for the training job.

* ``datasets.py``: built-in sets (scikit-learn's), ``.npz``, memory-mapped ``.npy`` pairs,
  CSV and Parquet; the stratified train / validation / test split; the standardisation
  fitted on train only (``tests/training/model/test_helpers.py``, ``test_cli.py``).
* ``parquet.py``: Parquet files, a column per feature or one list column of embeddings
  (``test_parquet.py``).
* ``synthetic.py``: classes of Gaussian clusters in a subspace, with an overlap knob, at any
  size (``test_synthetic.py``; ``benchmarks/scale.py``).
"""
