"""API keys for the public API: clients send `authorization: Bearer <key>`.

`ApiKeys.authenticate` is the one check, so that any front door (the gRPC interceptor
below; an OpenAI-style HTTP server later) refuses the same requests with the same
message. Keys are compared in constant time, against every configured key. The key
file is re-read when it changes: rotate a key by adding the new one, moving clients
over, then deleting the old one, without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from llmserve.settings import setting

logger = logging.getLogger(__name__)

# Open without a key: health probes (Kubernetes, compose, load balancers) carry no
# credentials. Reflection is NOT open: it hands out the whole API surface, and a keyed
# user loses nothing (grpcurl's -H header goes on its reflection calls too).
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class Unauthenticated(Exception):
    """A request without a valid key; the message says what is wrong (never the keys)."""


@dataclass(frozen=True, repr=False)
class ApiKeyOptions:
    api_key: str | None = setting(None, help="API key clients must send as `authorization: Bearer KEY` (a flag "
                                             "shows in `ps`: prefer the environment or --api-key-file)",
                                  unset="none")
    api_key_file: Path | None = setting(None, help="file of API keys, one per line (any of them is accepted)",
                                        unset="none")

    def __repr__(self) -> str:  # The config is logged at start-up: never the key itself.
        return f"ApiKeyOptions(api_key={'<set>' if self.api_key else None}, api_key_file={self.api_key_file})"

    def problem(self) -> str | None:
        """Why no key can be checked (None when there is one)."""
        try:
            if self.keys():
                return None
        except OSError as err:
            return f"--api-key-file: {err}"
        return ("the public API needs an API key: --api-key-file FILE or LLMSERVE_API_KEY (`llmserve certs` writes "
                "a key file), or --insecure to serve without one (debugging only)")

    def keys(self) -> list[str]:
        """Every configured key, now."""
        return ([self.api_key] if self.api_key else []) + (read_key_file(self.api_key_file)
                                                           if self.api_key_file is not None else [])


def read_key_file(path: Path) -> list[str]:
    """The keys of a key file: one a line, blank lines and #-comments skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _digest(key: str) -> bytes:
    # Equal-length digests: compare_digest's time then says nothing about a key's length.
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys a client may present: `keys`, and those of `file` as it is now (a stat
    per check; re-read when it changed; an unreadable or empty rewrite keeps the keys
    it had, so a botched edit does not lock every client out)."""

    def __init__(self, keys: Iterable[str] = (), file: Path | None = None):
        self._fixed = tuple(_digest(k) for k in keys if k)
        self._file = Path(file) if file is not None else None
        self._stamp: tuple[int, int, int] | None = None
        self._from_file: tuple[bytes, ...] = ()
        if self._file is not None:
            self._from_file = tuple(map(_digest, read_key_file(self._file)))
            self._stamp = self._file_stamp()
        if not self._fixed + self._from_file:
            raise ValueError("no API key configured")

    @classmethod
    def from_options(cls, options: ApiKeyOptions) -> "ApiKeys":
        return cls([options.api_key] if options.api_key else [], options.api_key_file)

    def _file_stamp(self) -> tuple[int, int, int]:
        s = os.stat(self._file)
        return s.st_ino, s.st_mtime_ns, s.st_size

    def _digests(self) -> tuple[bytes, ...]:
        if self._file is None:
            return self._fixed
        try:
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp  # Tried once per change, whatever comes of it.
                keys = read_key_file(self._file)
                if not keys:
                    raise ValueError("no key in it")
                self._from_file = tuple(map(_digest, keys))
                logger.info("API key file %s reloaded: %d keys", self._file, len(keys))
        except (OSError, ValueError) as err:
            logger.warning("API key file %s changed but cannot be used (%s); keeping its previous keys",
                           self._file, err)
        return self._fixed + self._from_file

    def valid(self, key: str) -> bool:
        """Constant time: every configured key is compared, whichever matches."""
        presented = _digest(key)
        found = False
        for digest in self._digests():
            found |= hmac.compare_digest(digest, presented)
        return found

    def authenticate(self, authorization: str | None) -> None:
        """Checks an `authorization` header/metadata value; raises Unauthenticated."""
        if not authorization:
            raise Unauthenticated("missing API key: send the metadata `authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed authorization: expected `Bearer <key>`")
        if not self.valid(key.strip()):
            raise Unauthenticated("invalid API key")


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # An unknown method: refused all the same, so nobody learns which exist.
        return grpc.unary_unary_rpc_method_handler(refuse)
    factory = _HANDLERS[(handler.request_streaming, handler.response_streaming)]
    return factory(refuse, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid key with UNAUTHENTICATED, but OPEN_METHODS."""

    def __init__(self, keys: ApiKeys, open_methods: frozenset[str] = OPEN_METHODS):
        self.keys, self.open_methods = keys, open_methods

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self.open_methods:
            return await continuation(handler_call_details)
        authorization = next((value for key, value in handler_call_details.invocation_metadata or ()
                              if key == "authorization"), None)
        try:
            self.keys.authenticate(authorization)
        except Unauthenticated as err:
            return _refusal(await continuation(handler_call_details), str(err))
        return await continuation(handler_call_details)
