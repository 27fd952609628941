"""Security without a model: certificates, API keys on a TLS server, mutual TLS, peer
roles, certificate hot reload, and how a service refuses to start unsafely.

The servers here are the services' own ServiceServer (the same credentials code the
router, scheduler and worker run), in process; tests/e2e/test_security.py does the
same against a real cluster."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmserve.certs import CertificateAuthority, write_credentials
from llmserve.contract.api_keys import ApiKeyInterceptor, ApiKeyOptions, ApiKeys, Unauthenticated
from llmserve.contract.grpc_server import ServerOptions, ServiceServer
from llmserve.contract.security import SecurityOptions, channel_credentials
from llmserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve.v1 import generation_pb2 as pb
from llmserve.v1 import generation_pb2_grpc as pb_grpc

HEALTH = health_pb2.HealthCheckRequest()
SERVING = health_pb2.HealthCheckResponse.SERVING


def serving_options(credentials, role: str) -> SecurityOptions:
    return SecurityOptions(tls_cert=credentials.cert(role), tls_key=credentials.key(role), tls_ca=credentials.ca)


# --- certificates -----------------------------------------------------------------------


def test_llmserve_certs_writes_a_set_and_rotates_it_under_the_same_ca(tmp_path):
    out = tmp_path / "certs"
    run = [sys.executable, "-m", "llmserve.cli", "certs", "--out", str(out), "--hosts", "router,scheduler,10.0.0.7"]
    assert subprocess.run(run, capture_output=True, text=True, timeout=60).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o700
    for name in ("ca.key", "router.key", "scheduler.key", "worker.key", "api-key"):
        assert (out / name).stat().st_mode & 0o777 == 0o600, name  # Secrets: owner only.
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    first = {}
    for role in ("router", "scheduler", "worker"):
        cert = x509.load_pem_x509_certificate((out / f"{role}.crt").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"llmserve-{role}"
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["localhost", "router", "scheduler"]
        assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.7"]
        first[role] = cert.serial_number
    key = (out / "api-key").read_text()
    assert len(key.strip()) >= 32
    # Again: same CA and key, new role certificates (what running services then reload).
    assert subprocess.run(run, capture_output=True, text=True, timeout=60).returncode == 0
    assert x509.load_pem_x509_certificate((out / "ca.crt").read_bytes()) == ca
    assert (out / "api-key").read_text() == key
    for role, serial in first.items():
        cert = x509.load_pem_x509_certificate((out / f"{role}.crt").read_bytes())
        assert cert.serial_number != serial
        cert.verify_directly_issued_by(ca)


def test_ca_key_kept_apart_and_throwaway_sets_write_none(tmp_path):
    creds = write_credentials(tmp_path / "certs", ca_key=tmp_path / "ca" / "ca.key")
    assert (tmp_path / "ca" / "ca.key").exists() and not (creds.dir / "ca.key").exists()
    throwaway = write_credentials(tmp_path / "throwaway", keep_ca_key=False)
    assert sorted(p.name for p in throwaway.dir.iterdir()) == [
        "api-key", "ca.crt", "router.crt", "router.key", "scheduler.crt", "scheduler.key", "worker.crt", "worker.key"]


# --- API keys -----------------------------------------------------------------------------


def test_api_keys_accept_any_configured_key_and_say_what_is_wrong(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nfirst-key\n\n  second-key  \n")
    options = ApiKeyOptions(api_key="env-key", api_key_file=key_file)
    assert options.keys() == ["env-key", "first-key", "second-key"]
    assert "env-key" not in repr(options)  # The config is logged at start-up.
    keys = ApiKeys(options.keys())
    for key in ("env-key", "first-key", "second-key"):
        keys.authenticate(f"Bearer {key}")
        keys.authenticate(f"bearer {key}")
    for header, message in ((None, "missing API key"), ("", "missing API key"), ("first-key", "malformed"),
                            ("Basic Zmlyc3Qta2V5", "malformed"), ("Bearer ", "malformed"),
                            ("Bearer first-ke", "invalid API key"), ("Bearer first-key2", "invalid API key")):
        with pytest.raises(Unauthenticated, match=message):
            keys.authenticate(header)
    with pytest.raises(ValueError):
        ApiKeys([])
    assert ApiKeyOptions().problem() is not None and options.problem() is None
    assert "no such file" in ApiKeyOptions(api_key_file=tmp_path / "missing").problem().lower()


def test_key_file_rotation_needs_no_restart(tmp_path, caplog):
    key_file = tmp_path / "keys"
    key_file.write_text("old-key\n")
    keys = ApiKeys.from_options(ApiKeyOptions(api_key="env-key", api_key_file=key_file))
    assert keys.valid("old-key") and keys.valid("env-key") and not keys.valid("new-key")
    key_file.write_text("old-key\nnew-key\n")  # Add the new key: both work meanwhile...
    assert keys.valid("old-key") and keys.valid("new-key")
    _replace(key_file, b"new-key\n")  # ...then drop the old one.
    assert keys.valid("new-key") and not keys.valid("old-key") and keys.valid("env-key")
    with caplog.at_level(logging.WARNING, logger="llmserve.contract.api_keys"):
        _replace(key_file, b"# emptied by mistake\n")  # Keeps the keys it had, and says so.
        assert keys.valid("new-key")
        key_file.unlink()
        assert keys.valid("new-key")
    assert "cannot be used" in caplog.text


class Echo(pb_grpc.GenerationServicer):
    async def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=[1, 2], count=2, prompt=request.text)

    async def Generate(self, request, context):
        yield pb.GenerateResponse(request_id="r", text=request.text)


@pytest_asyncio.fixture(loop_scope="function")
async def public_server(credentials):
    """The router's public port as serve() builds it: TLS, no client certificates, the
    API key interceptor, health and reflection."""
    from grpc_reflection.v1alpha import reflection

    name = "llmserve.v1.Generation"
    server = ServiceServer(name, "127.0.0.1", 0, serving_options(credentials, "router"), client_auth=False,
                           interceptors=[ApiKeyInterceptor(ApiKeys([credentials.api_key]))])
    pb_grpc.add_GenerationServicer_to_server(Echo(), server.server)
    reflection.enable_server_reflection((name, reflection.SERVICE_NAME), server.server)
    await server.start()
    await server.set_serving(True)
    try:
        yield f"localhost:{server.port}"
    finally:
        await server.stop(None)


async def test_public_port_requires_the_key_but_for_health(public_server, credentials):
    unkeyed = channel_credentials(credentials.ca)
    for api_key in (None, "wrong-key"):
        creds = channel_credentials(credentials.ca, api_key=api_key)
        async with grpc.aio.secure_channel(public_server, creds) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for call in (stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5),
                         _first(stub.Generate(pb.GenerateRequest(text="hi"), timeout=5))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert err.value.details() == ("missing API key: send the metadata `authorization: Bearer <key>`"
                                               if api_key is None else "invalid API key")
            # Health stays open (probes carry no key); reflection does not.
            assert (await health_pb2_grpc.HealthStub(ch).Check(HEALTH, timeout=5)).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _list_services(ch)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.secure_channel(public_server, unkeyed) as ch:
        # The key as plain call metadata works as well as gRPC's call credentials.
        metadata = (("authorization", f"Bearer {credentials.api_key}"),)
        reply = await pb_grpc.GenerationStub(ch).Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata,
                                                          timeout=5)
        assert reply.prompt == "hi"
        assert "llmserve.v1.Generation" in await _list_services(ch, metadata)
        # An unknown method is refused too: nobody learns which exist without the key.
        unknown = ch.unary_unary("/llmserve.v1.Generation/Nope")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unknown(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.secure_channel(public_server, channel_credentials(credentials.ca,
                                                                         api_key=credentials.api_key)) as ch:
        replies = [r async for r in pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="hey"), timeout=5)]
        assert [r.text for r in replies] == ["hey"]


async def test_public_port_is_tls_only(public_server, foreign_credentials):
    # A client that does not trust the cluster's CA (here: another CA's) cannot connect,
    # and nor can a plaintext one.
    for ch in (grpc.aio.secure_channel(public_server, channel_credentials(foreign_credentials.ca)),
               grpc.aio.insecure_channel(public_server)):
        async with ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(HEALTH, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def _first(call):
    async for reply in call:
        return reply


async def _list_services(channel, metadata=None) -> set[str]:
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(metadata=metadata, timeout=5)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    return {s.name for s in reply.list_services_response.service}


# --- mutual TLS and hot reload ------------------------------------------------------------


def _served_serial(port: int, credentials, role: str = "router") -> int:
    """The serial number of the certificate a new TLS connection to `port` is shown."""
    context = ssl.create_default_context(cafile=str(credentials.ca))
    context.load_cert_chain(credentials.cert(role), credentials.key(role))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


async def _health(port: int, creds: grpc.ChannelCredentials) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(HEALTH, timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK


async def test_internal_server_requires_a_client_certificate_from_its_ca(credentials, foreign_credentials):
    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, serving_options(credentials, "scheduler"))
    await server.start()
    try:
        port = server.port
        ours = channel_credentials(credentials.ca, credentials.cert("router"), credentials.key("router"))
        assert await _health(port, ours) == grpc.StatusCode.OK
        # No client certificate, or one from another CA: refused at the handshake.
        assert await _health(port, channel_credentials(credentials.ca)) == grpc.StatusCode.UNAVAILABLE
        theirs = channel_credentials(credentials.ca, foreign_credentials.cert("router"),
                                     foreign_credentials.key("router"))
        assert await _health(port, theirs) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_rotated_certificate_is_served_to_new_connections(tmp_path, credentials, caplog):
    """Rewrite the files with a new certificate from the same CA: the next connection
    sees its serial, no restart. A half-done rotation (the new certificate, the old key)
    is not served: the server keeps the last whole pair."""
    own = write_credentials(tmp_path / "rotating")  # A CA of its own: rotation re-signs with it.
    options = serving_options(own, "scheduler")
    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, options)
    await server.start()
    try:
        port = server.port
        first = x509.load_pem_x509_certificate(own.cert("scheduler").read_bytes()).serial_number
        assert await asyncio.to_thread(_served_serial, port, own) == first
        ca = CertificateAuthority.load(own.ca.read_bytes(), (own.dir / "ca.key").read_bytes())
        new = ca.issue("llmserve-scheduler", ["localhost", "127.0.0.1"])
        half = ca.issue("llmserve-scheduler", ["localhost", "127.0.0.1"])
        # Rewritten in place (a new mtime tells), as `cp` or an editor would.
        own.key("scheduler").write_bytes(new.key_pem)
        own.cert("scheduler").write_bytes(new.cert_pem)
        second = x509.load_pem_x509_certificate(new.cert_pem).serial_number
        assert await asyncio.to_thread(_served_serial, port, own) == second != first
        creds = channel_credentials(own.ca, own.cert("router"), own.key("router"))
        assert await _health(port, creds) == grpc.StatusCode.OK
        with caplog.at_level(logging.WARNING, logger="llmserve.contract.cert_reload"):
            _replace(own.cert("scheduler"), half.cert_pem)  # Renamed into place; its key has not landed yet.
            assert await asyncio.to_thread(_served_serial, port, own) == second
        assert "does not belong to the certificate" in caplog.text
        _replace(own.key("scheduler"), half.key_pem)  # Now it has.
        third = x509.load_pem_x509_certificate(half.cert_pem).serial_number
        assert await asyncio.to_thread(_served_serial, port, own) == third
        assert server.certificates.serial == third
    finally:
        await server.stop(None)


def _replace(path: Path, data: bytes) -> None:
    """An atomic rotation (what `llmserve certs` does): a new file renamed over the old."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- peer roles ---------------------------------------------------------------------------


async def test_register_worker_refuses_every_role_but_a_worker(credentials):
    """The scheduler's own servicer: a router's or another scheduler's certificate (valid,
    same CA) cannot register a worker; the refusal says why."""
    from llmserve.scheduler.config import SchedulerServiceConfig
    from llmserve.scheduler.service import SchedulerServicer

    config = SchedulerServiceConfig(security=serving_options(credentials, "scheduler"))
    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, config.security)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(config, server), server.server)
    await server.start()
    try:
        for role in ("router", "scheduler"):
            creds = channel_credentials(credentials.ca, credentials.cert(role), credentials.key(role))
            async with grpc.aio.secure_channel(f"localhost:{server.port}", creds) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(
                        scheduler_pb2.RegisterWorkerRequest(address="localhost:1"), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.value.details() == (f"RegisterWorker is for the llmserve worker only; the caller's "
                                           f"certificate names llmserve-{role} (expected CN llmserve-worker)")
    finally:
        await server.stop(None)


# --- how services start -------------------------------------------------------------------


def test_standalone_services_default_to_loopback():
    assert ServerOptions().host == "127.0.0.1"
    for module in ("router", "scheduler", "worker"):
        from importlib import import_module

        config = {"router": "RouterConfig", "scheduler": "SchedulerServiceConfig", "worker": "WorkerConfig"}[module]
        assert getattr(import_module(f"llmserve.{module}.config"), config)().server.host == "127.0.0.1"


def test_a_service_without_tls_files_refuses_to_start():
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "scheduler", "--port", "0"], capture_output=True,
                         text=True, timeout=60, env=_env_without_llmserve())
    assert out.returncode == 2
    assert "TLS is on by default and needs --tls-cert, --tls-key, --tls-ca" in out.stderr
    assert "--insecure" in out.stderr


def test_a_router_without_an_api_key_refuses_to_start(credentials):
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "router", "--port", "0",
                          *credentials.service_flags("router")], capture_output=True, text=True, timeout=60,
                         env=_env_without_llmserve())
    assert out.returncode == 2 and "the public API needs an API key" in out.stderr


def test_insecure_warns_and_binds_loopback_by_default():
    """A scheduler run alone with --insecure and no --host: it says it is insecure, and
    it listens on 127.0.0.1 only (what the kernel says, not what the log says)."""
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "scheduler", "--insecure", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=_env_without_llmserve())
    try:
        lines, port = [], None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            if " listening on " in line:
                port = int(line.split(" listening on ")[1].split()[0].rsplit(":", 1)[1])
        log = "".join(lines)
        assert "WARNING" in log and "--insecure: the scheduler runs WITHOUT TLS and without authentication" in log
        assert "(plaintext: --insecure)" in log
        assert _listening_addresses(port) == ["127.0.0.1"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_up_takes_insecure_but_makes_its_own_credentials():
    from llmserve.launcher.up import UpConfig
    from llmserve.settings import options

    names = {o.name for o in options(UpConfig)}
    assert "insecure" in names
    assert not names & {"tls-cert", "tls-key", "tls-ca", "api-key", "api-key-file"}


def _env_without_llmserve() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}


def _listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port`, as the kernel lists
    them (gRPC listens on IPv6 sockets: 127.0.0.1 shows as a v4-mapped address)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            found.append(str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip))
    return found
