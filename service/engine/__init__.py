"""The engine: a loaded model and the one inference path. No web imports.

* ``model.py``: ``LoadedModel`` (projection, index, labels, calibration; immutable data)
  and ``load_model`` (read the artifact, build or read its index, warm it up)
  (``tests/service/engine/test_engine.py``, ``tests/service/search/test_indexing.py``).
* ``engine.py``: ``Engine``: the current model (swapped in one assignment) and the
  operations every wire calls, ``classify``, ``neighbors`` and ``embed``, each owning the
  in-flight gate, the batcher or worker thread, the trace spans and the events the metrics
  count (``tests/service/engine/test_engine.py``, ``test_robustness.py``).
* ``events.py``: ``EngineEvents``, what the engine reports (loads, requests admitted,
  outliers flagged, batches); ``service.ops.metrics.Metrics`` counts them.
* ``batcher.py``: the ``Batcher``, concurrent requests grouped by (model, k) into one
  search (``tests/service/engine/test_batcher.py``).
* ``infer.py``: ``Query``, ``Answer``, ``resolve`` (a request's k, rule and outlier
  threshold, the same for every wire) and ``infer``: embed, overflow check, one search, one
  decision per rule, the only place the service decides.
"""
