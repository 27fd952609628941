"""`llmserve`: start the services (alone or as a local cluster) and talk to them.

    llmserve up [--prompt TEXT]       router + scheduler + worker on localhost
    llmserve router|scheduler|worker  one service (docker-compose, Kubernetes)
    llmserve generate "prompt"        stream an answer from a running cluster
    llmserve certs --out DIR          a CA, per-role certificates and an API key

Each installed distribution adds its own commands (entry points `llmserve.commands`):
an image with only the scheduler installed offers `llmserve scheduler`, not `worker`.
Every setting of a service is a flag, an environment variable LLMSERVE_<FLAG> and a key
of its `--config FILE` (YAML or TOML); the command line wins, then the environment,
then the file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from llmserve.contract.startup_errors import StartupError, rpc_cause, run_reporting
from llmserve.settings import Command, SettingsError, add_flags, resolve

logger = logging.getLogger("llmserve")
COMMAND_GROUP = "llmserve.commands"
# `llmserve generate` stops after this many tokens unless --max-tokens says otherwise: a
# small model asked an open question may otherwise repeat itself to max_model_len.
GENERATE_MAX_TOKENS = 256


# --- client commands, always present ---------------------------------------------------


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _connection_arguments(p: argparse.ArgumentParser, client_cert: bool) -> None:
    """How a client command reaches a secure service: the flags, or the LLMSERVE_* variables
    the services read (a health check inside a service's container needs no flags)."""
    env = os.environ.get
    p.add_argument("--tls-ca", default=env("LLMSERVE_TLS_CA"),
                   help="CA certificate to verify the server against (default: $LLMSERVE_TLS_CA, else the "
                        "system's roots)")
    if client_cert:
        p.add_argument("--tls-cert", default=env("LLMSERVE_TLS_CERT"),
                       help="client certificate, which the scheduler and worker require, e.g. the service's own "
                            "(default: $LLMSERVE_TLS_CERT)")
        p.add_argument("--tls-key", default=env("LLMSERVE_TLS_KEY"),
                       help="its private key (default: $LLMSERVE_TLS_KEY)")
    else:
        p.add_argument("--api-key", default=env("LLMSERVE_API_KEY"), help="the router's API key (default: "
                       "$LLMSERVE_API_KEY; a flag shows in `ps`: prefer the variable or --api-key-file)")
        p.add_argument("--api-key-file", type=Path, default=None, help="read the API key from this file")
    p.add_argument("--insecure", action="store_true", default=_env_flag("LLMSERVE_INSECURE"),
                   help="plaintext, for a service run with --insecure (default: $LLMSERVE_INSECURE)")


def _health_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="localhost:50051", help="service address (default: %(default)s)")
    p.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default: %(default)s)")
    _connection_arguments(p, client_cert=True)


def _health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from llmserve.contract.security import channel_credentials

    try:
        creds = None if args.insecure else channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as err:  # A probe says why in one line, not a traceback.
        print(f"{args.target}: {err}", file=sys.stderr)
        return 1
    try:
        channel = grpc.insecure_channel(args.target) if creds is None else grpc.secure_channel(args.target, creds)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"{args.target}: {err.code().name} {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--target", default=os.environ.get("LLMSERVE_TARGET", "localhost:50051"),
                   help="router address (default: $LLMSERVE_TARGET, else localhost:50051)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=GENERATE_MAX_TOKENS,
                   help="stop after this many tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    _connection_arguments(p, client_cert=False)


def _generate(args) -> int:
    import grpc

    from llmserve.client import LLMServeClient

    api_key = args.api_key_file.read_text().strip() if args.api_key_file else args.api_key

    async def main() -> int:
        async with LLMServeClient(args.target, api_key=api_key, tls_ca=args.tls_ca, insecure=args.insecure) as client:
            kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
            if args.chat:
                stream = client.generate(messages=[{"role": "user", "content": args.prompt}], **kwargs)
            else:
                stream = client.generate(args.prompt, **kwargs)
            try:
                async for delta in stream:
                    print(delta.text, end="", flush=True)
            except grpc.aio.AioRpcError as err:
                raise _router_error(args.target, err) from err
            print()
        return 0

    return asyncio.run(main())


def _router_error(target: str, err) -> StartupError:
    """A failed call to the router as the cause and what to change on this side. Only a
    connection that failed is "cannot reach": a status the router sent (a worker lost
    mid-stream, none ready) is reported as it came, and so is a stream cut off midway."""
    from llmserve.client import StreamFailed, is_transport_failure

    code = err.code().name
    if code == "UNAUTHENTICATED":
        return StartupError(f"the router at {target} refused the call: {err.details()}",
                            "set LLMSERVE_API_KEY, or --api-key-file, to a key the router accepts")
    if isinstance(err, StreamFailed):
        if err.transport:
            return StartupError(f"lost the connection to the router at {target} mid-stream: "
                                f"{rpc_cause(code, err.details())}")
        return StartupError(f"the request failed mid-stream ({code}): {err.details()}")
    if code == "UNAVAILABLE" and is_transport_failure(err):
        cause = rpc_cause(code, err.details())
        fix = "is `llmserve up` running? --target sets the router's address"
        if "TLS" in cause or "certificate" in cause:
            fix = "set LLMSERVE_TLS_CA to the CA file `llmserve up` logs, or --insecure for a cluster run with it"
        return StartupError(f"cannot reach the router at {target}: {cause}", fix)
    return StartupError(f"the router at {target} answered {code}: {err.details()}")


BUILTIN = (
    Command("generate", "stream an answer from a running cluster", None, _generate, _generate_arguments),
    Command("health", "exit 0 if a service's grpc.health.v1 says SERVING (probes)", None, _health,
            _health_arguments),
)


# --- the parser -------------------------------------------------------------------------


def load_commands(only: str | None = None) -> dict[str, Command]:
    """The built-in commands and those of every installed llmserve distribution; with
    `only`, just that one's entry point is loaded (if a distribution registers it)."""
    commands = {command.name: command for command in BUILTIN}
    # NOTE: a distribution registers only commands whose imports it depends on (`up` comes
    # with llmserve-launcher, which requires every service), so an entry point that fails
    # to load is a broken install, and says so.
    for point in sorted(entry_points(group=COMMAND_GROUP), key=lambda p: p.name):
        if only is None or point.name == only:
            command = point.load()
            commands[command.name] = command
    return commands


def requested_command(argv: list[str]) -> str | None:
    """The subcommand argv names (its first positional word), or None (`--help`, none)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line: the usage of a service command lists dozens of
    flags, which would bury the error (--help prints them)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    commands = load_commands() if commands is None else commands
    parser = _Parser(prog="llmserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default=os.environ.get("LLMSERVE_LOG_LEVEL", "INFO"),
                        help="(default: %(default)s; env LLMSERVE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands.values():
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if command.config is not None:
            add_flags(p, command.config)
            p.add_argument("--config", type=Path, default=None, metavar="FILE",
                           help="YAML or TOML file of these settings (the command line and LLMSERVE_* "
                                "variables override it)")
        if command.add_arguments is not None:
            command.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Only the named command's distribution is imported: a service started by the local
    # cluster would otherwise import every installed command's modules (bench's: torch)
    # before serving. A name no entry point has loads them all, so the error lists them.
    name = requested_command(argv)
    commands = load_commands(only=name)
    if name not in commands:
        commands = load_commands()
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{args.command}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    command = commands[args.command]
    if command.config is None:
        args.argv = ["llmserve", *argv]
        return run_reporting(args.command, lambda: command.run(args))
    try:
        config = resolve(command.config, args, file=args.config)
    except (SettingsError, OSError) as err:
        parser.error(str(err))
    (logger.debug if command.logs_config else logger.info)("config: %s", config)
    # Every failure of every command, start-up or later, ends as one line (see startup_errors).
    return run_reporting(args.command, lambda: command.run(config))


if __name__ == "__main__":
    sys.exit(main())
