"""`bench throughput --baseline llama-cpp`: llama.cpp's `llama-server` on the round's
workload, one system per GGUF precision (--llama-cpp-quant), so our engine's ratio to
llama.cpp is measured in the same run as our engine, not in commands minutes apart.

`scripts/build_llama_cpp.sh` builds the server and the GGUFs into --llama-cpp-dir
(bin/llama-server, models/<model>-<precision>.gguf). Each system starts its own server
(nothing cached from a previous round), sized for the workload: one slot per request
(at most the engine's --max-num-seqs, so both batch alike), each slot holding the
workload's longest request, the engine's CPU threads. The requests go all at once
through the OpenAI client of `bench serve --backend openai`, greedy with eos ignored,
and are timed as run_through_grpc times ours. The stream carries text, not token ids, so
there is no greedy-token comparison with the engine; each request's `usage` must show
exactly its output length instead.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from llmserve.bench.llama_server import STARTUP_TIMEOUT_S, LlamaServer, LlamaServerError, ServerSettings, \
    server_command
from llmserve.bench.workloads import BenchRequest

QUANTS = ("F32", "BF16", "Q8_0", "Q4_K_M")
DEFAULT_DIR = ".cache/llama.cpp"
BUILD_COMMAND = "bash scripts/build_llama_cpp.sh"
SYSTEM_PREFIX = "llama-cpp-"  # A throughput system's name: llama-cpp-F32, llama-cpp-Q8_0, ...
# llama-server's per-slot context is rounded up to this many tokens (and one spare past the
# longest request, so that its last token never meets the slot's end).
CONTEXT_ROUNDING = 64


class LlamaCppNotBuilt(SystemExit):
    """A one-line exit message: what is missing, and the command that builds it."""


def default_quant(dtype: str, quantization: str) -> str:
    """The GGUF precision matching the engine's weights: float32 -> F32, bfloat16 -> BF16,
    weight-only int8 (whatever the activations) -> Q8_0."""
    if quantization != "none":
        return "Q8_0"
    matching = {"float32": "F32", "bfloat16": "BF16"}
    if dtype not in matching:
        raise SystemExit(f"--baseline llama-cpp: no GGUF matches the engine's {dtype}; pick one with "
                         f"--llama-cpp-quant ({' '.join(QUANTS)})")
    return matching[dtype]


def chosen_quants(args, dtype: str, quantization: str) -> list[str]:
    """--llama-cpp-quant's precisions in order, without repeats, or the engine's match."""
    if "llama-cpp" not in args.baseline:
        if args.llama_cpp_quant:
            raise SystemExit("--llama-cpp-quant needs --baseline llama-cpp")
        return []
    return list(dict.fromkeys(args.llama_cpp_quant or [default_quant(dtype, quantization)]))


def system_name(quant: str) -> str:
    return SYSTEM_PREFIX + quant


def quant_of(system: str) -> str | None:
    return system[len(SYSTEM_PREFIX):] if system.startswith(SYSTEM_PREFIX) else None


def label(quant: str) -> str:
    return f"llama.cpp llama-server {quant}"


@dataclass(frozen=True)
class LlamaCppBuild:
    """The layout scripts/build_llama_cpp.sh writes under its --out directory."""

    root: Path

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    def gguf(self, model_name: str, quant: str) -> Path:
        return self.root / "models" / f"{model_name}-{quant.lower()}.gguf"

    def check(self, model_name: str, quants: list[str]) -> None:
        """Raises LlamaCppNotBuilt naming the first missing file, before anything runs
        (no precisions asked for: nothing to check)."""
        if not quants:
            return
        for path in [self.server, *(self.gguf(model_name, q) for q in quants)]:
            if not path.is_file():
                raise LlamaCppNotBuilt(f"--baseline llama-cpp: {path} is missing; build it with `{BUILD_COMMAND}` "
                                       f"(or point --llama-cpp-dir at its --out directory)")


def server_settings(requests: list[BenchRequest], max_slots: int, threads: int) -> ServerSettings:
    """Every request in a slot of its own at once (up to max_slots), any slot able to
    hold the longest request (llama-server hands a request to whichever slot is free)."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    slot_context = math.ceil((longest + 1) / CONTEXT_ROUNDING) * CONTEXT_ROUNDING
    return ServerSettings(slots=max(1, min(len(requests), max_slots)), slot_context=slot_context, threads=threads)


async def _one(client, r: BenchRequest) -> int:
    """Streams one request; returns the completion tokens its usage reports (-1: none)."""
    reported = -1
    async for delta in client.generate(token_ids=r.prompt_token_ids, max_tokens=r.output_len, temperature=0.0,
                                       ignore_eos=True):
        if delta.completion_tokens is not None:
            reported = delta.completion_tokens
    return reported


async def _run_workload(url: str, requests: list[BenchRequest]) -> tuple[float, list[int]]:
    from llmserve.bench.openai_backend import OpenAIClient

    async with OpenAIClient(f"{url}/v1") as client:
        # The same warm-up request as run_through_grpc sends to our cluster.
        await _one(client, BenchRequest(requests[0].prompt_token_ids[:16], 2))
        start = time.perf_counter()
        generated = await asyncio.gather(*(_one(client, r) for r in requests))
        return time.perf_counter() - start, list(generated)


def _short_requests(requests: list[BenchRequest], generated: list[int]) -> str:
    """'' when every request's usage shows its output length; else which did not."""
    wrong = [(i, n, r.output_len) for i, (r, n) in enumerate(zip(requests, generated)) if n != r.output_len]
    if not wrong:
        return ""
    i, n, want = wrong[0]
    got = "no usage" if n < 0 else f"{n} tokens"
    return f"{len(wrong)} of {len(requests)} requests did not generate their max_tokens (r{i}: {got}, not {want})"


def run_llama_cpp(build: LlamaCppBuild, model_name: str, quant: str, requests: list[BenchRequest],
                  settings: ServerSettings, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
    """One round of llama-server at `quant`: the result dict of run_through_grpc's shape
    (less `outputs`), or {"error": ...} when the server failed or a request came back
    short (then its throughput would not be the workload's): one precision failing (as
    quantized GGUFs crashed on the Intel AMX host) leaves the run's other figures."""
    from llmserve.launcher.cluster import free_port

    port = free_port()
    gguf = build.gguf(model_name, quant)
    command = server_command(build.server, gguf, port, settings)
    # NOTE: the build copies llama.cpp's shared libraries beside the binary.
    libraries = ":".join(filter(None, [str(build.server.parent), os.environ.get("LD_LIBRARY_PATH")]))
    server = LlamaServer(command, port, startup_timeout_s, env={"LD_LIBRARY_PATH": libraries})
    try:
        with server:
            try:
                seconds, generated = asyncio.run(_run_workload(server.url, requests))
                failure = _short_requests(requests, generated)
            except Exception as err:  # The server's log says more than the client's error.
                failure = f"{type(err).__name__}: {err}"
            if failure:
                return {"error": f"llama.cpp {quant}: {failure}\n--- llama-server log (tail) ---\n{server.log_tail()}"}
    except LlamaServerError as err:
        return {"error": str(err)}
    out_tokens = sum(generated)
    return {"seconds": seconds, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / seconds,
            "llama_server": {"gguf": str(gguf), "command": " ".join(command), "slots": settings.slots,
                             "slot_context": settings.slot_context, "threads": settings.threads}}
