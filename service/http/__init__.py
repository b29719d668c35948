"""The ``/v1`` HTTP wire: JSON and npy in and out. Imports nothing from ``service.oip``.

* ``request.py``: a request from the raw ASGI request to checked rows and a ``Query`` (key,
  media types, streamed body limit, strict parse, query options), and the encoded response
  (``tests/service/test_api.py``, ``test_bad_input_corpus.py``).
* ``payload.py``: the JSON request bodies as msgspec structs (``test_bad_input_corpus.py``).
* ``render.py``: answers rendered as JSON or structured ``.npy`` (``test_render.py``).
* ``schemas.py``: the response models the OpenAPI document shows.
* ``deps.py``: FastAPI dependencies: the state and the API-key checks.
* ``routes/``: one module per resource: ``inference`` (classify, embed, neighbors),
  ``model`` (metadata, reload), ``health`` (probes, metrics)
  (``test_api.py``, ``test_openapi_statuses.py``, ``test_fuzz_openapi.py``).
"""
