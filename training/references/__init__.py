"""The reference set as data: every change is a new artifact version with its lineage.

* ``versions.py``: add rows (projected with the existing map), remove ids, write a version
  (``tests/training/references/test_references.py``).
* ``condense.py``: Wilson editing, condensing and per-class prototypes
  (``tests/training/references/test_condense.py``).
* ``learned.py``: prototypes learned with NCA's objective (Stochastic Neighbor Compression):
  the objective, its closed-form gradient, L-BFGS with the best validation iteration kept
  (``tests/training/references/test_learned_references.py``).
* ``compress.py``: a learned reference set: Wilson editing when it would remove at least 5%
  of the rows, the served k, the manifest's ``reference_set``
  (``tests/training/references/test_learned_references.py``).
* ``cli.py``: ``python -m training references add|remove|condense``.
"""
