"""A stand-in for llama.cpp's `llama-server`, for tests on machines without llama.cpp:
the same command line, /health answering 503 "loading" and then ok, /v1/models, and
/v1/completions streamed in OpenAI's chunk format with the usage at the end, as
llama-server sends them. It refuses (HTTP 400) a completion request that lacks what the
benchmark relies on: token-id prompt, greedy, ignore_eos, streamed usage.

Behaviour for a test, from the environment:
  FAKE_LLAMA_LOADING_S    seconds /health says "loading" (default 0.3)
  FAKE_LLAMA_SHORT_BY     generate this many tokens fewer than max_tokens (default 0)
  FAKE_LLAMA_EXIT         print it as an error and exit 1 at once (a model that fails to load)
  FAKE_LLAMA_IGNORE_TERM  any value: ignore SIGTERM (only SIGKILL stops it)
  FAKE_LLAMA_RECORD       append {"pid", "argv"} as a JSON line to this file at start
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("-np", type=int, required=True)
    parser.add_argument("-c", type=int, required=True)
    parser.add_argument("-t", type=int, required=True)
    return parser.parse_args(argv)


def chunk(model: str, text: str, finish_reason: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def completion_problem(body: dict) -> str:
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return "prompt must be a list of token ids"
    if body.get("temperature") != 0.0 or body.get("ignore_eos") is not True or body.get("stream") is not True:
        return "want temperature 0, ignore_eos, stream"
    if not (body.get("stream_options") or {}).get("include_usage"):
        return "want stream_options.include_usage"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "want max_tokens"
    return ""


def main() -> None:
    args = parse_args(sys.argv[1:])
    if os.environ.get("FAKE_LLAMA_RECORD"):
        with open(os.environ["FAKE_LLAMA_RECORD"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:]}) + "\n")
    if os.environ.get("FAKE_LLAMA_EXIT"):
        print(f"error: {os.environ['FAKE_LLAMA_EXIT']}", flush=True)
        sys.exit(1)
    if os.environ.get("FAKE_LLAMA_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready_at = time.monotonic() + float(os.environ.get("FAKE_LLAMA_LOADING_S", "0.3"))
    short_by = int(os.environ.get("FAKE_LLAMA_SHORT_BY", "0"))
    print(f"fake llama-server: {args.np} slots, context {args.c}, {args.t} threads, model {args.m}", flush=True)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:  # Quiet: the log holds only what a test looks for.
            pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                if time.monotonic() < ready_at:
                    self.reply(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
                else:
                    self.reply(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": args.m, "object": "model", "created": 0,
                                                             "owned_by": "llamacpp"}]})
            else:
                self.reply(404, {"error": {"code": 404, "message": "File Not Found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or time.monotonic() < ready_at:
                self.reply(404 if self.path != "/v1/completions" else 503, {"error": {"message": "not here"}})
                return
            if problem := completion_problem(body):
                self.reply(400, {"error": {"code": 400, "message": problem}})
                return
            tokens = max(0, body["max_tokens"] - short_by)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(tokens):
                self.wfile.write(chunk(args.m, f" t{i}"))
                self.wfile.flush()
            usage = {"completion_tokens": tokens, "prompt_tokens": len(body["prompt"]),
                     "total_tokens": tokens + len(body["prompt"])}
            self.wfile.write(chunk(args.m, "", "length", usage))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
