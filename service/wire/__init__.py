"""Requests, read the same way on every wire (HTTP /v1, the Open Inference Protocol's REST
and gRPC): who may call, what may come in, and how it becomes rows. One module per concern:

* ``caller.py``: the app state of a request and the API key (exactly one
  ``Authorization: Bearer <key>``, compared in constant time);
* ``media.py``: the Content-Type check and Accept negotiation (RFC 9110);
* ``bodies.py``: the body-size limit for a model, and reading a body while it streams in,
  its bytes reserved in the worker's budget of bodies in flight;
* ``integers.py``: integers off a wire, strictly (ASCII digits only, bounded);
* ``arrays.py``: one strict decode of a JSON body, a checked ``.npy`` body, ``.npy`` bytes out;
* ``rows.py``: the input rows, checked and made a float32 (n, D) array.

The wires import what they use from here (the names below). Every refusal is one of
``service.errors``' types and names what was wrong and what was expected. No web framework
is imported here (``tests/test_boundaries.py``). Tests:
``tests/service/http/test_bad_input_corpus.py``, ``tests/service/wire/test_wire_integers.py``,
``test_api.py``, ``tests/service/oip/test_v2_protocol.py``.
"""

from service.wire.arrays import npy_bytes, parse_json, parse_npy
from service.wire.bodies import THREAD_PARSE_BYTES, body_limit, describe_unicode_error, read_body
from service.wire.caller import check_key, state_of
from service.wire.integers import check_int_range, finite_number, parse_count
from service.wire.media import JSON, NPY, check_media, negotiate
from service.wire.rows import to_rows, to_sparse_rows

__all__ = [
    "JSON",
    "NPY",
    "THREAD_PARSE_BYTES",
    "body_limit",
    "check_int_range",
    "check_key",
    "check_media",
    "describe_unicode_error",
    "finite_number",
    "negotiate",
    "npy_bytes",
    "parse_count",
    "parse_json",
    "parse_npy",
    "read_body",
    "state_of",
    "to_rows",
    "to_sparse_rows",
]
