"""The engine: a loaded model and the one inference path. No web imports.

* ``model.py``: ``LoadedModel`` (projection, index, labels, calibration; immutable data)
  and ``load_model`` (read the artifact, build or read its index, warm it up)
  (``tests/service/test_engine.py``, ``test_indexing.py``).
* ``infer.py``: what a request runs through once its wire has parsed it: ``Engine`` (the
  current model, swapped in one assignment; the in-flight gate), the ``Batcher`` (concurrent
  requests grouped by (model, k)), and ``infer``: embed, overflow check, one search, one
  decision per rule, the only place the service decides (``tests/service/test_engine.py``,
  ``test_batcher.py``, ``test_robustness.py``).
"""
