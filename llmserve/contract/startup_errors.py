"""One line per failure: what every `llmserve` command prints when it cannot start or run.

    worker: --model /data/llama: no such directory (pass a local Hugging Face model ...)
    ^process ^cause                                 ^fix

Code that knows why a start-up failed raises `StartupError(cause, fix)`; `run_reporting`
(around every command, in `llmserve.cli.main`) turns it, or any other exception, into
that one line on stderr and a non-zero exit code. The traceback is logged at DEBUG
only: a user who made a mistake needs the fix, not the stack (`--log-level DEBUG`
shows both).
"""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130  # The shell's code for a process ended by Ctrl-C.


class StartupError(Exception):
    """A failure whose cause and fix are known: printed as "process: cause (fix)"."""

    def __init__(self, cause: str, fix: str = ""):
        super().__init__(cause)
        self.cause = cause
        self.fix = fix


def one_line(process: str, exc: BaseException) -> str:
    """The line printed for `exc`: a StartupError as it says, anything else by its type and
    message (the traceback is for DEBUG)."""
    if isinstance(exc, StartupError):
        return f"{process}: {exc.cause}" + (f" ({exc.fix})" if exc.fix else "")
    text = " ".join(str(exc).split()) or "(no message)"  # One line, however the message is wrapped.
    return f"{process}: {type(exc).__name__}: {text} (--log-level DEBUG shows the traceback)"


def run_reporting(process: str, run: Callable[[], int]) -> int:
    """`run()`'s exit code; any exception becomes one line on stderr and exit code 1."""
    try:
        return run()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure gets its one line, known or not.
        logger.debug("%s failed", process, exc_info=exc)
        print(one_line(process, exc), file=sys.stderr, flush=True)
        return EXIT_FAILURE


def address_in_use(err: OSError) -> bool:
    return err.errno == errno.EADDRINUSE


def port_error(what: str, host: str, port: int, flag: str, err: OSError | None = None) -> StartupError:
    """A port that cannot be bound, with the OS's reason when known ("address already in use")."""
    reason = "address already in use" if err is None or address_in_use(err) else (err.strerror or str(err)).lower()
    return StartupError(f"cannot listen on {host}:{port} for {what}: {reason}",
                        f"another process holds the port: stop it, or choose another with {flag}")


# Substrings of gRPC's status details -> the short cause a person can act on. gRPC puts
# the OS's reason at the end of a long C-core line ("failed to connect to all addresses;
# last error: UNAVAILABLE: ipv4:127.0.0.1:50052: Connection refused").
_RPC_CAUSES = (
    ("Connection refused", "connection refused"),
    ("DNS resolution failed", "host name not found"),
    ("CERTIFICATE_VERIFY_FAILED", "its TLS certificate is not signed by --tls-ca"),
    ("WRONG_VERSION_NUMBER", "TLS on one side only (one of the two runs with --insecure)"),
    ("Ssl handshake failed", "the TLS handshake failed"),
    ("Socket closed", "the connection was closed (TLS on one side only?)"),
    ("Connection reset", "the connection was reset (TLS on one side only?)"),
    ("No route to host", "no route to host"),
    ("Network is unreachable", "network unreachable"),
)


def rpc_cause(code_name: str, details: str, timeout_s: float | None = None) -> str:
    """A gRPC failure (status code name and details) as a short cause."""
    for needle, cause in _RPC_CAUSES:
        if needle in (details or ""):
            return cause
    if code_name == "DEADLINE_EXCEEDED" and timeout_s is not None:
        return f"no answer within {timeout_s:.0f} s"
    return f"{code_name}: {' '.join((details or '').split())}"
