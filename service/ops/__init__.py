"""Operations: what keeps the service observable and standing.

* ``metrics.py``: Prometheus metrics with labels from fixed sets, per app, multiprocess-aware
  (``tests/service/test_metric_labels.py``).
* ``connections.py``: uvicorn's HTTP protocol with a header timeout, header limits and a
  connection cap; the open-files check (``tests/service/test_connections.py``).
* ``memory.py``: handing freed memory back to the OS after large requests.
* ``workers.py``: the reload generation several workers share (``test_server.py``).
* ``logs.py``: structured JSON log lines (``tests/service/test_ops.py``).
"""
