"""The gRPC messages of the Open Inference Protocol and of gRPC health checking, built at
import from the descriptor set ``protocol.binpb`` that ``protoc`` compiles from
``open_inference.proto`` and ``health.proto`` (``make protos``; a test checks it is current).

The messages live in a private descriptor pool, not protobuf's default one: a process that
also imports a client of the protocol (tritonclient registers the same ``inference.*``
names) must not clash with the server's definitions.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

DESCRIPTOR_SET = Path(__file__).with_name("protocol.binpb")

_files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes())
pool = descriptor_pool.DescriptorPool()
for _file in _files.file:
    pool.Add(_file)


def message(full_name: str):
    """The message class of ``full_name`` (e.g. ``inference.ModelInferRequest``)."""
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


INFERENCE_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
