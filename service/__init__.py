"""nca-knn's online half: the artifact contract, the kNN core and the service.

The tree shows the layers; each package's docstring names its modules and their tests.

* ``core/``: numpy and the standard library only, shared with ``training``: the vocabulary
  of rules and index kinds, the kNN rule, the artifact format.
* ``engine/``: a loaded model, and the engine that runs requests on it: the in-flight gate,
  the batcher and the one inference path (``infer``).
* ``search/``: FAISS indexes at run time, and the offline tuner (``nca-index``).
* ``http/``: the ``/v1`` JSON and npy routes: parsing, rendering, OpenAPI bodies.
* ``oip/``: the Open Inference Protocol: tensors, REST (``/v2``) and gRPC.
* ``ops/``: metrics, connection limits, memory, worker sync, logs.
* ``wire/``: how every wire reads a request: the API key, media types, bodies, strict
  integers, input rows.
* ``app.py`` composes the wires (lifespan, middleware, ``/v1`` and ``/v2``, OpenAPI,
  gRPC); ``state.py`` is what the wires share at run time; ``config.py`` the one Settings;
  ``errors.py`` the one error table; ``__main__.py`` runs it under uvicorn.

``http`` and ``oip`` never import each other (``wire/`` imports neither); ``engine``, ``search`` and ``core`` import no
web framework. Importing this package (or ``service.core``) pulls in numpy and the standard
library only (``tests/test_boundaries.py`` checks all of it).
"""

__version__ = "0.1.0"
