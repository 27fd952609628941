"""CLI flags: sizes, environment-variable defaults, and every service command parses."""

import argparse

import pytest

from llmserve.cli import apply_env_defaults, build_parser, parse_bytes


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_environment_variables_set_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("LLMSERVE_KV_CACHE_MEMORY", "1GiB")
    monkeypatch.setenv("LLMSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMSERVE_NO_CHUNKED_PREFILL", "true")
    parser = build_parser()
    apply_env_defaults(parser)
    worker = parser.parse_args(["worker"])
    assert worker.kv_cache_memory == 2**30
    scheduler = parser.parse_args(["scheduler"])
    assert scheduler.max_num_seqs == 7 and scheduler.no_chunked_prefill is True
    assert parser.parse_args(["scheduler", "--max-num-seqs", "9"]).max_num_seqs == 9


@pytest.mark.parametrize("argv", [["up"], ["router"], ["scheduler"], ["worker"], ["generate", "hi"]])
def test_every_command_parses_with_defaults(argv):
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


@pytest.mark.parametrize("front", [["up"], ["bench", "serve"], ["bench", "throughput"]])
def test_scheduler_flags_reach_the_launched_scheduler_unchanged(front):
    from llmserve.launcher import scheduler_flags

    parser = build_parser()
    given = ["--max-num-seqs", "7", "--max-num-batched-tokens", "300", "--no-chunked-prefill",
             "--no-prefix-caching", "--preemption-mode", "swap", "--stream-interval", "4",
             "--num-scheduler-steps", "8"]
    outer = parser.parse_args(front + given)
    inner = parser.parse_args(["scheduler", *scheduler_flags(outer)])
    for name in ("max_num_seqs", "max_num_batched_tokens", "no_chunked_prefill", "no_prefix_caching",
                 "preemption_mode", "stream_interval", "num_scheduler_steps"):
        assert getattr(inner, name) == getattr(outer, name) != getattr(parser.parse_args(["scheduler"]), name), name
    for flag in ("--stream-interval", "--num-scheduler-steps"):
        with pytest.raises(SystemExit):
            parser.parse_args(["scheduler", flag, "0"])
