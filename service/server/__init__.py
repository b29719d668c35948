"""How a server process serves: the HTTP server's connections, its workers and its probes.
No web framework routes here; uvicorn runs these beside the application.

* ``connections.py``: uvicorn's HTTP protocol with every phase of a connection bounded in time
  and memory (accept cap, header and body deadlines and sizes, early answers, send deadline,
  lingering closes); the open-files check (``tests/service/server/test_connections.py``,
  ``test_body_phase.py``).
* ``accept.py``: new connections accepted in batches (``test_probes.py``).
* ``probes.py``: the probe listener and the workers' heartbeats (``test_probes.py``).
* ``workers.py``: the reload generation several workers share (``test_server.py``).
"""
