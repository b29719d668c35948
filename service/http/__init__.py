"""The ``/v1`` HTTP wire: JSON and npy in and out. Imports nothing from ``service.oip``.

* ``routes/``: one module per resource:
  * ``inference``: POST /v1/classify, /v1/embed and /v1/neighbors, from the raw request to
    the encoded answer: the checks and the strict parse (through ``service.wire``), the
    query options, the engine, and the answers as JSON or structured ``.npy``
    (``tests/service/http/test_api.py``, ``test_bad_input_corpus.py``, ``test_render.py``);
  * ``model``: metadata and reload; ``health``: probes and metrics
  (``test_api.py``, ``test_openapi_statuses.py``, ``test_fuzz_openapi.py``).
* ``schemas.py``: the response models the OpenAPI document shows.
* ``deps.py``: FastAPI dependencies: the state and the API-key checks.
* ``card.py``: the model card page at ``/`` (``test_model_card.py``).
"""
