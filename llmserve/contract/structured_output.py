"""A StructuredOutput as an xgrammar `Grammar`: the one definition of what each kind
means, shared by the router (which parses it before anything is queued, so that a bad
schema is the client's 400) and the worker (which compiles it against the tokenizer).

NOTE: xgrammar is imported inside the functions: the router and worker distributions
install it; the base `llmserve` distribution (the contract) pulls no torch and so no
xgrammar.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re

from llmserve.contract.sampling import STRUCTURED_OUTPUT_KINDS, StructuredOutput

# xgrammar prefixes its errors with a timestamp and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def choice_grammar_ebnf(choices: list[str]) -> str:
    """An EBNF grammar deriving exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as err:
        raise ValueError(f"choice: the spec must be a JSON array of strings ({err})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice: the spec must be a non-empty JSON array of non-empty strings")
    return choices


def build_grammar(so: StructuredOutput):
    """so as an `xgrammar.Grammar`; ValueError naming the problem when it is not one."""
    import xgrammar as xgr

    if so.kind not in STRUCTURED_OUTPUT_KINDS:
        raise ValueError(f"unknown structured output kind {so.kind!r} (one of {', '.join(STRUCTURED_OUTPUT_KINDS)})")
    try:
        if so.kind == "json_schema":
            # NOTE: strict: no properties beyond the schema's unless it allows them.
            return xgr.Grammar.from_json_schema(so.spec, strict_mode=True)
        if so.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.spec)
        if so.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar_ebnf(_choices(so.spec)))
        return xgr.Grammar.from_ebnf(so.spec)
    except RuntimeError as err:  # xgrammar's parse errors.
        raise ValueError(f"{so.kind}: {_LOCATION.sub('', str(err)).strip()}") from None


def can_compile() -> bool:
    """xgrammar is installed here. It is a worker dependency (it needs torch): a router
    installed alone lacks it, and its worker is then where a spec that cannot compile
    fails (the step that carries it)."""
    return importlib.util.find_spec("xgrammar") is not None


@functools.lru_cache(maxsize=256)
def check_structured_output(so: StructuredOutput) -> str | None:
    """None if `so` parses into a grammar, else why not (cached per (kind, spec): a
    client repeating a schema pays for it once). Blocking: call it off the event loop."""
    try:
        build_grammar(so)
    except ValueError as err:
        return str(err)
    return None
