"""The README's snippets work as written: its Python blocks run against a real cluster,
every `llmserve` command line in its bash blocks parses with the real parser, and those
safe to run (generate, certs) run. The documentation site's command lines parse too
(its dated benchmark history aside: old runs used the flags of their day)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.cli import build_parser, load_commands
from llmserve.settings import resolve

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOC_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "benchmarks-history.md")
SAFE_TO_RUN = {"generate", "certs"}  # Talk to the test cluster, or write into a temporary directory.


def blocks(language: str, page: Path = README) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def llmserve_commands(pages: tuple[Path, ...] = (README,)) -> list[list[str]]:
    """Every `llmserve ...` command line of the pages' bash blocks (the README's by default),
    as argv (continuation lines joined, comments and leading VAR=value assignments dropped)."""
    commands = []
    for block in (b for page in pages for b in blocks("bash", page)):
        for line in block.replace("\\\n", " ").splitlines():
            if re.search(r"(^|\s)llmserve\s", line):  # Not other tools' lines (grpcurl's JSON spans lines).
                words = shlex.split(line, comments=True)
                commands.append(words[words.index("llmserve"):])
    return commands


def client_env(cluster) -> dict[str, str]:
    """The variables the README has users export, pointing at the test cluster."""
    return dict(os.environ, LLMSERVE_TARGET=cluster.router_address, LLMSERVE_TLS_CA=str(cluster.credentials.ca),
                LLMSERVE_API_KEY=cluster.api_key, OPENAI_BASE_URL=cluster.http_url)


def test_the_readme_has_snippets():
    assert len(blocks("python")) >= 1
    names = {argv[1] for argv in llmserve_commands() if len(argv) > 1}
    assert {"up", "generate", "certs", "scheduler", "worker", "router", "bench"} <= names, names


@pytest.mark.parametrize("argv", llmserve_commands(), ids=" ".join)
def test_every_command_line_parses(argv):
    args = build_parser().parse_args(argv[1:])  # SystemExit (a failed test) on any unknown or bad flag.
    command = load_commands()[args.command]
    if command.config is not None:
        resolve(command.config, args, environ={}, file=args.config)  # Values parse too (2GiB, ports).


def test_the_docs_have_command_lines():
    assert len(llmserve_commands(tuple(DOC_PAGES))) >= 20


@pytest.mark.parametrize("argv", llmserve_commands(tuple(DOC_PAGES)), ids=" ".join)
def test_every_docs_command_line_parses(argv):
    test_every_command_line_parses(argv)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_snippet_runs(cluster, index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(blocks("python")[index])
    result = subprocess.run([sys.executable, str(script)], env=client_env(cluster), capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "the snippet printed nothing"


@pytest.mark.slow
def test_safe_command_lines_run(cluster, tmp_path):
    ran = set()
    for argv in llmserve_commands():
        if argv[1] not in SAFE_TO_RUN:
            continue
        # NOTE: a later --max-tokens wins: 16 tokens keep the suite's time down (the 256-token
        # default alone is tested in tests/test_first_contact.py).
        cap = ["--max-tokens", "16"] if argv[1] == "generate" else []
        result = subprocess.run([sys.executable, "-m", "llmserve.cli", *argv[1:], *cap], env=client_env(cluster),
                                capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, (argv, result.stderr[-3000:])
        assert "Traceback" not in result.stderr
        if argv[1] == "generate":
            assert result.stdout.strip(), argv
        ran.add(" ".join(argv))
    assert 'llmserve generate --chat Write a haiku about gRPC' in ran  # The one that ran for 8 minutes.
    assert (tmp_path / "certs" / "ca.crt").is_file()
