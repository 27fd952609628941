"""gRPC server reflection for the router: both protocol versions, with source comments.

grpcurl, `buf curl`, Postman and grpcui discover the API through reflection. Newer
clients ask for `grpc.reflection.v1`, older ones for `grpc.reflection.v1alpha`;
grpcio-reflection implements only v1alpha. The two protocols are the same messages
under two package names (same fields, same numbers), so one servicer answers both:
v1 requests are decoded with the v1alpha message classes.

The descriptors grpcio-reflection serves come from the Python descriptor pool, which
protoc's Python output builds without source comments. For the public API, this
servicer serves llmserve.v1's descriptor set generated with --include_source_info
(llmserve.v1.DESCRIPTOR_SET), so `grpcurl describe` and `buf curl` show the .proto's
documentation; every other file (health, reflection) still comes from the pool.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer
from grpc_reflection.v1alpha.reflection import SERVICE_NAME as V1ALPHA_SERVICE_NAME

import llmserve.v1

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def load_commented_files(path=llmserve.v1.DESCRIPTOR_SET) -> dict[str, bytes]:
    """File name -> serialized FileDescriptorProto with source_code_info."""
    files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file
    return {f.name: f.SerializeToString() for f in files}


class CommentedReflectionServicer(ReflectionServicer):
    """grpcio-reflection's servicer, answering with commented descriptors where it has them."""

    def __init__(self, service_names, commented_files: dict[str, bytes]) -> None:
        super().__init__(service_names)
        self._commented = commented_files

    def _file_by_filename(self, request, filename):
        return self._with_comments(super()._file_by_filename(request, filename))

    def _file_containing_symbol(self, request, fully_qualified_name):
        return self._with_comments(super()._file_containing_symbol(request, fully_qualified_name))

    def _with_comments(self, response: reflection_pb2.ServerReflectionResponse):
        if not response.HasField("file_descriptor_response"):
            return response
        files = response.file_descriptor_response.file_descriptor_proto
        for i, serialized in enumerate(files):
            # Parse only the name (field 1) to find our file; swap in the commented copy.
            name = descriptor_pb2.FileDescriptorProto.FromString(serialized).name
            if name in self._commented:
                files[i] = self._commented[name]
        return response


def enable_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and themselves."""
    listed = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = CommentedReflectionServicer(listed, load_commented_files())
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )
