"""Tool-call parsers (issue #33, item 4): each format's calls and content, the same
whether the reply arrives whole, token by token or cut in two anywhere; a call's name
goes out once, in its first piece, and its argument pieces join to exactly the
arguments the model wrote (json.loads of the whole reply's call is the reference)."""

from __future__ import annotations

import json
import re

import pytest

from llmserve.router.tool_parsers import TOOL_CALL_PARSERS
from llmserve.router.tool_parsers.required import NamedCallParser, required_parser
from llmserve.router.tools import FirstCallOnly

from .test_reasoning import every_cut


def parse(new_parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)] per call, every delta) of a reply fed in `pieces`."""
    parser = new_parser()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = parser.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += calls
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id:  # A call's first piece, and only that one, names it.
            assert delta.index == len(calls) and delta.name, deltas
            calls[delta.index] = [delta.name, delta.arguments]
        else:
            assert not delta.name and delta.index in calls and delta.arguments, deltas
            calls[delta.index][1] += delta.arguments
    assert parser.called == bool(calls)
    return content, [tuple(call) for call in calls.values()], deltas


def _calls(*objects: dict) -> list[tuple[str, str]]:
    return [(o["name"], o["arguments"]) for o in objects]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": [1, 2], "unit": null}}'
SEARCH = '{"arguments": {"q": "}{ ]", "n": 10}, "name": "search"}'  # Arguments before the name.

CASES = [
    # hermes: text outside the tags is content; whitespace that only separates calls is not.
    ("hermes", f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{SEARCH}\n</tool_call>\n",
     "Let me look.", [("get_weather", '{"city": "Paris, \\"FR\\"", "days": [1, 2], "unit": null}'),
                      ("search", '{"q": "}{ ]", "n": 10}')]),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call> Done.', "Done.", [("ping", "{}")]),
    ("hermes", "No tools: a < b, <tool_ and </tool_call>.\n", "No tools: a < b, <tool_ and </tool_call>.\n", []),
    ("hermes", "<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', "", [("f", '{"a": 1')]),  # Cut off by max_tokens.
    # llama3_json: a reply that starts with a call is calls (';'-separated); any other is content.
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "a;b"}}; {"name": "g", "parameters": {}}',
     "", [("f", '{"x": "a;b"}'), ("g", "{}")]),
    ("llama3_json", ' {"name": "f", "parameters": {"x": 1}}', "", [("f", '{"x": 1}')]),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call in it.
    # mistral: content, then [TOOL_CALLS] and an array (or, the tag dropped as a special token, the array).
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": "]"}}, {"name": "g", "arguments": {}}]',
     "Sure.", [("f", '{"x": "]"}'), ("g", "{}")]),
    ("mistral", '[{"name": "f", "arguments": {"x": 1}}]', "", [("f", '{"x": 1}')]),
    ("mistral", "[1, 2] is a list [TOOL", "[1, 2] is a list [TOOL", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_calls_and_content_do_not_depend_on_where_the_reply_is_cut(parser, text, content, calls):
    for pieces in every_cut(text):
        assert parse(TOOL_CALL_PARSERS[parser], pieces + [""])[:2] == (content, calls), pieces


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_arguments_are_the_json_the_model_wrote(parser):
    # The reference: the call objects as json.loads reads them, in each format's frame.
    objects = [json.loads(WEATHER), json.loads(SEARCH)]
    if parser == "llama3_json":
        objects = [{"name": o["name"], "parameters": o["arguments"]} for o in objects]
    frame = {"hermes": "<tool_call>{}</tool_call>\n".format, "llama3_json": "{};".format,
             "mistral": lambda body: f"[TOOL_CALLS][{body}]"}[parser]
    text = frame(json.dumps(objects[0])) + frame(json.dumps(objects[1])) if parser != "mistral" else \
        frame(", ".join(json.dumps(o) for o in objects))
    content, calls, _ = parse(TOOL_CALL_PARSERS[parser], list(text))
    assert content == ""
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        (o["name"], o.get("arguments", o.get("parameters"))) for o in objects]


def test_call_ids_are_openai_style_and_mistral_style():
    _, _, deltas = parse(TOOL_CALL_PARSERS["hermes"], [f"<tool_call>{WEATHER}</tool_call>"])
    assert re.fullmatch(r"call_[0-9a-f]{24}", deltas[0].id)
    _, _, deltas = parse(TOOL_CALL_PARSERS["mistral"], ['[TOOL_CALLS][{"name": "f", "arguments": {}}]'])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", deltas[0].id)


def test_arguments_stream_as_they_arrive_and_are_never_taken_back():
    parser = TOOL_CALL_PARSERS["hermes"]()
    assert parser.feed("Hi <tool") == ("Hi", [])  # "<tool" may start a tag: held.
    content, calls = parser.feed('_call>{"name": "f", "arguments": {"city": "Pa')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"city": "Pa')]
    content, calls = parser.feed('ris"}}</tool_call>', final=True)
    assert [(c.id, c.name, c.arguments) for c in calls] == [("", "", 'ris"}')]


def test_required_reply_is_a_json_array_of_calls():
    text = '[{"name": "f", "arguments": {"a": [1, {"b": "]"}]}}, {"name": "g", "arguments": {}}]'
    for pieces in every_cut(text):
        content, calls, _ = parse(required_parser, pieces)
        assert content == ""
        assert [(n, json.loads(a)) for n, a in calls] == [(o["name"], o["arguments"]) for o in json.loads(text)]


def test_named_function_reply_is_its_arguments():
    for pieces in every_cut('{"city": "Paris"}'):
        assert parse(lambda: NamedCallParser("get_weather"), pieces)[:2] == ("", [("get_weather", '{"city": "Paris"}')])


def test_first_call_only_keeps_one_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse(lambda: FirstCallOnly(TOOL_CALL_PARSERS["hermes"]()), list(text))[:2] == ("", [("f", "{}")])
