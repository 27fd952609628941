"""A refusal with a retry hint in gRPC's rich error model: a google.rpc.Status whose
details hold a google.rpc.RetryInfo, sent in the `grpc-status-details-bin` trailer.

Clients in any language read it with their gRPC status library (Go `status.FromError`
then `Details()`, Java `StatusProto.fromThrowable`, Python `grpc_status.rpc_status`);
`retry_delay_s` below is the Python client's shortcut.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DETAILS_KEY = "grpc-status-details-bin"


def retry_status(code: grpc.StatusCode, message: str, retry_after_ms: int) -> grpc.Status:
    """The status to abort a call with (context.abort_with_status): `code`, `message`
    and a RetryInfo of `retry_after_ms`."""
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromMilliseconds(retry_after_ms)
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """The RetryInfo delay (seconds) a failed call's trailers carry, or None."""
    for key, value in error.trailing_metadata() or ():
        if key != DETAILS_KEY:
            continue
        for detail in status_pb2.Status.FromString(value).details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return info.retry_delay.ToMilliseconds() / 1000
    return None
