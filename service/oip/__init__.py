"""The Open Inference Protocol (KServe V2) over REST and gRPC, on the same engine, limits,
auth, metrics and error table as ``/v1``. Imports nothing from ``service.http``.

* ``tensors.py``: the protocol's model metadata, input tensors to rows, output tensors from
  an answer, and ``run_call``: a call on the engine, whatever the wire.
* ``rest.py``: the ``/v2`` routes, with the binary tensor data extension.
* ``grpc_server.py``: ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``.
* ``protocol/``: the ``.proto`` files and the compiled descriptor set the server loads.

Tests: ``tests/service/oip/test_v2_protocol.py`` (tritonclient over both wires),
``test_protocol_files.py``, ``tests/service/wire/test_wire_integers.py``.
"""
