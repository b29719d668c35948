"""The gRPC descriptor set the service loads is what its .proto files compile to, and its
messages speak the protocol's wire format (tritonclient's own messages read them)."""

from __future__ import annotations

import subprocess
import sys

from google.protobuf import descriptor_pb2

from service.oip.protocol import DESCRIPTOR_SET, message

PROTOS = ("open_inference.proto", "health.proto")


def test_the_descriptor_set_is_compiled_from_the_proto_files(tmp_path):
    import grpc_tools  # noqa: F401  (a dev dependency: missing fails the test)

    out = tmp_path / "protocol.binpb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{DESCRIPTOR_SET.parent}",
            f"--descriptor_set_out={out}",
            *PROTOS,
        ],
        check=True,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    stored = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes())
    assert fresh == stored, "run `make protos` and commit service/oip/protocol/protocol.binpb"


def test_our_messages_and_tritonclients_read_each_other():
    from tritonclient.grpc import service_pb2

    ours = message("inference.ModelInferRequest")()
    ours.model_name, ours.id = "nca-knn", "7"
    ours.parameters["k"].int64_param = 5
    ours.parameters["rule"].string_param = "soft"
    tensor = ours.inputs.add(name="input", datatype="FP32", shape=[2, 3])
    tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    ours.outputs.add(name="label")
    ours.raw_input_contents.append(b"\x00" * 24)
    theirs = service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert theirs.parameters["k"].int64_param == 5 and theirs.inputs[0].shape == [2, 3]
    assert list(theirs.inputs[0].contents.fp32_contents) == [1, 2, 3, 4, 5, 6]
    assert theirs.outputs[0].name == "label" and theirs.raw_input_contents == [b"\x00" * 24]
    response = service_pb2.ModelInferResponse(model_name="nca-knn", model_version="v")
    response.outputs.add(name="label", datatype="INT64", shape=[1])
    response.raw_output_contents.append(b"\x01" + b"\x00" * 7)
    back = message("inference.ModelInferResponse").FromString(response.SerializeToString())
    assert back.outputs[0].datatype == "INT64" and back.raw_output_contents[0][0] == 1
