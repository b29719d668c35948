"""The numpy-only core that training and the service share (no web framework, no FAISS).

* ``vocabulary.py``: the decision rules and index kinds, named once
  (``tests/test_boundaries.py``).
* ``knn.py``: the projection z = x W^T + b, exact kNN in float64, the decision rules
  (majority, soft, soft_prior), outlier calibration and thresholds: the one decision
  function offline evaluation and online serving both call (``tests/service/core/test_knn.py``,
  ``test_far_away.py``).
* ``npy.py``: the ``.npy`` format (header, data) read without ``ast``, which CPython 3.11
  does not make safe across threads: request bodies and artifact arrays
  (``tests/service/core/test_npy.py``).
* ``artifact/``: the artifact format (``artifact/format.py``: file names, dtypes, shapes,
  manifest keys, the model version, checksums), the invariants the writer enforces and the
  reader checks (``artifact/invariants.py``), the pinned read (``artifact/read.py``) and the
  atomic write (``artifact/write.py``) (``tests/service/core/test_artifact.py``, ``test_artifact_corpus.py``,
  ``test_version_identity.py``, ``tests/service/engine/test_robustness.py``).
"""
