"""Operations: what keeps the service observable and within its resources.

* ``metrics.py``: Prometheus metrics with labels from fixed sets, per app, multiprocess-aware
  (``tests/service/ops/test_metric_labels.py``).
* ``model_info.py``: ``ncaknn_model_info``, one series per worker: the model it serves now
  (``tests/service/ops/test_model_info.py``).
* ``tracing.py``: OpenTelemetry spans per request (``tests/service/ops/test_tracing.py``).
* ``logs.py``: one JSON object per log line, repeats rate-limited (``test_logging.py``).
* ``bodies.py``: the budget of request bodies a worker holds at once (``tests/service/server/test_body_phase.py``).
* ``answers.py``: the budget of answers a worker holds for clients that have not taken them
  (``test_answers.py``, ``tests/service/server/test_answer_phase.py``).
* ``memory.py``: handing freed memory back to the OS after large requests.
"""
