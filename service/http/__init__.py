"""The ``/v1`` HTTP wire: JSON and npy in and out. Imports nothing from ``service.oip``.

* ``routes/``: one module per resource:
  * ``inference``: POST /v1/classify, /v1/embed and /v1/neighbors, each decode -> engine
    -> encode (``tests/service/http/test_api.py``, ``test_bad_input_corpus.py``,
    ``test_render.py``);
  * ``model``: metadata and reload; ``health``: probes and metrics
  (``test_api.py``, ``test_openapi_statuses.py``, ``test_fuzz_openapi.py``).
* ``decode.py``: reading an inference request: the checks and the strict parse (through
  ``service.wire``), the query options, the query resolved against the model.
* ``encode.py``: the answers as JSON or structured ``.npy``, large ones in a worker thread.
* ``schemas.py``: the response models the OpenAPI document shows.
* ``deps.py``: FastAPI dependencies: the state and the API-key checks.
* ``card.py``: the model card page at ``/`` (``test_model_card.py``).
* ``head.py``: HEAD answered as GET without a body on every GET route, this wire's and the
  others' (``tests/service/server/test_head.py``).
"""
