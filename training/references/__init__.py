"""The reference set as data: every change is a new artifact version with its lineage.

* ``versions.py``: add rows (projected with the existing map), remove ids, write a version
  (``tests/training/test_references.py``).
* ``condense.py``: Wilson editing, condensing and per-class prototypes
  (``tests/training/test_condense.py``).
* ``cli.py``: ``python -m training references add|remove|condense``.
"""
