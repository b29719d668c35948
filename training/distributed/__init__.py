"""Data-parallel training with PyTorch's own distributed package (torchrun).

* ``ranks.py``: the process group, row shards, all-gathered embeddings and all-reduced
  gradients, so a sharded fit equals the single-process one (``tests/training/test_distributed.py``,
  ``test_torchrun_job.py``).
* ``sharded_stats.py``: the standardisation and initialisation statistics computed from
  shards with the same results as on the whole set (``test_distributed.py``).
"""
