"""The engine: a loaded model and the one inference path. No web imports.

* ``model.py``: ``LoadedModel`` (projection, index, labels, calibration; immutable),
  ``load_model`` (read, index, warm up) and ``Engine`` (the current model, swapped in one
  assignment; failed loads keep the old one) (``tests/service/test_engine.py``).
* ``infer.py``: ``Query`` and ``resolve`` (k, rule and outlier quantile checked for every
  wire), ``infer``: embed, overflow check, one search, one decision per rule: the only
  place the service decides (``tests/service/test_batcher.py``, ``test_engine.py``).
* ``batcher.py``: concurrent requests grouped by (model, k) into one ``infer`` call, on the
  event loop or a search thread (``tests/service/test_batcher.py``).
* ``rows.py``: input rows checked the same way for every wire (``test_bad_input_corpus.py``).
"""
