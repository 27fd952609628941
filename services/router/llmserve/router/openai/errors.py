"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status of the gRPC status the shared request path raised."""

from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

# gRPC status -> (HTTP status, OpenAI error type).
_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict]:
    """(HTTP status, body) for a gRPC status and its message."""
    status, kind = _BY_STATUS.get(code, (500, "internal_error"))
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}


def error_response(code: grpc.StatusCode, message: str, param: str | None = None,
                   retry_after_ms: int = 0, http_status: int | None = None) -> JSONResponse:
    """With a retry hint: `Retry-After` in whole seconds (HTTP's unit, rounded up), and
    `retry-after-ms`, which the OpenAI SDKs read before it. `http_status`: where HTTP
    has a more precise status than the gRPC code's (413 for a body too large)."""
    status, body = error_body(code, message, param)
    status = http_status or status
    headers = {}
    if retry_after_ms:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))), "retry-after-ms": str(retry_after_ms)}
    return JSONResponse(body, status_code=status, headers=headers)
