"""How a server process serves: the HTTP server's connections, its workers and its probes.
No web framework routes here; uvicorn runs these beside the application.

* ``connections.py``: uvicorn's HTTP protocol with every phase of a connection bounded in time
  and memory (accept cap, header and body deadlines and sizes, a minimum body rate, early
  answers, the send rule on what the client took, resets, the release of answers in
  flight, lingering closes); the open-files check
  (``tests/service/server/test_connections.py``, ``test_body_phase.py``,
  ``test_body_rate.py``, ``test_answer_phase.py``).
* ``accept.py``: new connections accepted in batches (``test_probes.py``).
* ``probes.py``: the probe listener and the workers' heartbeats (``test_probes.py``).
* ``workers.py``: the reload generation several workers share (``test_server.py``).
"""
