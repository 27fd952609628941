"""llmserve's public gRPC API, package llmserve.v1 (distribution `llmserve-api`).

    import grpc
    from llmserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

    stub = pb_grpc.GenerationStub(grpc.insecure_channel("localhost:50051"))
    for piece in stub.Generate(pb.GenerateRequest(text="Hello", params=pb.SamplingParams(max_tokens=16))):
        print(piece.text, end="")

PROTO_FILE is the .proto these modules were generated from (for other toolchains);
DESCRIPTOR_SET is a serialized FileDescriptorSet of it that keeps the source comments.
"""

from pathlib import Path

API_VERSION = "v1"
PROTO_FILE = Path(__file__).with_name("generation.proto")
DESCRIPTOR_SET = Path(__file__).with_name("generation.binpb")
