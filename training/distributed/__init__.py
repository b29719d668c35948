"""Data-parallel training with PyTorch's own distributed package (torchrun).

* ``ranks.py``: the process group (one process is a group of size 1), row shards and the
  collectives (all-gather of rows, rank 0's numbers broadcast) that the data-parallel
  objective (``training.optim.sharded_problem``) is built on
  (``tests/training/distributed/test_distributed.py``, ``test_torchrun_job.py``).
* ``sharded_stats.py``: the standardisation and initialisation statistics computed from
  shards with the same results as on the whole set (``test_distributed.py``).
"""
