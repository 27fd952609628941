"""Reasoning models (issue #33, item 5): --reasoning-parser splits a chat reply into
`reasoning_content` and `content` (streamed and not, tags cut anywhere), and
`chat_template_kwargs` reach the chat template. In process: the OpenAI app over ASGI with
a stub `Generation` whose replies go through the router's real SampleStream."""

from __future__ import annotations

import json
import shutil

import grpc
import httpx2
import openai
import pytest

from llmserve.contract.outputs import FinishReason, RequestOutput
from llmserve.router.generation import Generation, Output
from llmserve.router.reasoning import REASONING_PARSERS
from llmserve.router.sample_stream import SampleStream
from llmserve.router.stop_strings import StopStringMatcher
from llmserve.router.tokenizer import PromptTokenizer
from llmserve.router.usage import Usage
from llmserve.router.validation import RequestError, ServedModel
from llmserve.v1 import generation_pb2 as pb

from .test_openai_http import KEY, http


def split(parser: str, pieces: list[str], prompt_tail: str = "") -> tuple[str, str]:
    splitter = REASONING_PARSERS[parser](prompt_tail)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def every_cut(text: str) -> list[list[str]]:
    """`text` as one piece, one character a piece, and cut in two at every position."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


@pytest.mark.parametrize("parser,text,prompt_tail,expected", [
    ("think", "<think>\nI should greet.\n</think>\n\nHello!", "", ("I should greet.\n", "Hello!")),
    ("think", "Hello, no tags < here", "", ("", "Hello, no tags < here")),
    ("think", "Hi <think>not a tag after text</think>", "", ("", "Hi <think>not a tag after text</think>")),
    ("think", "<think>cut off by max_tokens <", "", ("cut off by max_tokens <", "")),  # Only the opening tag.
    # Qwen3-style template opened it (the prompt ends inside <think>): reasoning first.
    ("think", "plan</think>\n\nanswer", "<|im_start|>assistant\n<think>\n", ("plan", "answer")),
    # enable_thinking=false: the template wrote an empty, closed block; the reply is all answer.
    ("think", "answer", "<|im_start|>assistant\n<think>\n\n</think>\n\n", ("", "answer")),
    ("deepseek_r1", "plan</think>answer", "", ("plan", "answer")),  # Template-opened: no <think> in the reply.
    ("deepseek_r1", "<think>\nplan</think>answer", "", ("plan", "answer")),  # A repeated <think> is dropped.
    ("deepseek_r1", "all reasoning, never closed", "", ("all reasoning, never closed", "")),
])
def test_split_does_not_depend_on_where_the_text_is_cut(parser, text, prompt_tail, expected):
    for pieces in every_cut(text):
        assert split(parser, pieces + [""], prompt_tail) == expected, pieces


def test_a_held_tag_prefix_is_released_when_it_is_not_a_tag():
    splitter = REASONING_PARSERS["think"]("")
    assert splitter.feed("<think>a </th") == ("a ", "")  # "</th" may be the end tag: held.
    assert splitter.feed("ing") == ("</thing", "")
    assert splitter.feed("</think>b <", final=True) == ("", "b <")


# --- through the OpenAI front door ------------------------------------------------

REPLY = ["<th", "ink>", "\nI", " should", " greet.</", "think", ">\n\nHel", "lo!"]  # One token's text each.


class _Detokenizer:
    """Token id i is the text REPLY[i]."""

    def push(self, ids: list[int]) -> str:
        return "".join(REPLY[i] for i in ids)

    def flush(self) -> str:
        return ""


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "<|im_start|>assistant\n"


class StubGeneration(Generation):
    """Runs no scheduler: each sample's reply is REPLY, token by token, through the
    router's SampleStream and reasoning splitter (as Generation.generate does)."""

    def __init__(self, reasoning_parser: str):
        super().__init__(tokenizer=_Tokenizer(), replicas=None, metrics=None, reasoning_parser=reasoning_parser)
        self.served = ServedModel(name="m", max_model_len=64, vocab_size=len(REPLY), max_prompt_bytes=1024)
        self.requests: list[pb.GenerateRequest] = []

    @property
    def ready(self) -> bool:
        return True

    async def generate(self, request, metadata=(), deadline_ms=0, sampling=None):
        self.requests.append(request)
        stream = SampleStream(index=0, detokenizer=_Detokenizer(), stop_matcher=StopStringMatcher(()),
                              reasoning=self._splitter(request, [0]))
        for token in range(len(REPLY)):
            last = token == len(REPLY) - 1
            out = RequestOutput(request.request_id, new_token_ids=[token],
                                finish_reason=FinishReason.STOP if last else FinishReason.NONE)
            delta = stream.process(out, str)
            yield Output(request.request_id, delta, Usage.of(3, [stream]) if last else None)


def _sdk(generation: Generation) -> openai.AsyncOpenAI:
    transport = httpx2.ASGITransport(app=http(generation)._transport.app)
    return openai.AsyncOpenAI(base_url="http://router/v1", api_key=KEY, max_retries=0,
                              http_client=httpx2.AsyncClient(transport=transport))


MESSAGES = [{"role": "user", "content": "Hi"}]


async def test_chat_reply_splits_into_reasoning_and_content():
    async with _sdk(StubGeneration("think")) as client:
        reply = await client.chat.completions.create(model="m", messages=MESSAGES)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("I should greet.", "Hello!")


async def test_streamed_reasoning_comes_before_the_content():
    async with _sdk(StubGeneration("think")) as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        deltas = [chunk.choices[0].delta async for chunk in stream]
    kinds = [("reasoning", d.reasoning_content) if getattr(d, "reasoning_content", None) else ("content", d.content)
             for d in deltas if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == [("reasoning", "I"), ("reasoning", " should"), ("reasoning", " greet."),
                     ("content", "Hel"), ("content", "lo!")]
    assert deltas[0].role == "assistant"


async def test_without_a_parser_the_text_is_untouched_and_completions_never_split():
    async with _sdk(StubGeneration("none")) as client:
        reply = await client.chat.completions.create(model="m", messages=MESSAGES)
        assert reply.choices[0].message.content == "".join(REPLY)
        assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    async with _sdk(StubGeneration("think")) as client:
        completion = await client.completions.create(model="m", prompt="Hi")
    assert completion.choices[0].text == "".join(REPLY)


async def test_chat_template_kwargs_travel_as_json_values():
    generation = StubGeneration("none")
    kwargs = {"enable_thinking": False, "depth": 2, "names": ["a", "é"], "opts": {"x": None}}
    async with _sdk(generation) as client:
        await client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"chat_template_kwargs": kwargs})
    sent = generation.requests[0].messages.chat_template_kwargs
    assert {name: json.loads(text) for name, text in sent.items()} == kwargs


@pytest.mark.parametrize("value", [["enable_thinking"], "enable_thinking=false", 3])
async def test_chat_template_kwargs_must_be_an_object(value):
    async with http(StubGeneration("none")) as client:
        reply = await client.post("/v1/chat/completions",
                                  json={"model": "m", "messages": MESSAGES, "chat_template_kwargs": value})
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("chat_template_kwargs")


# --- the chat template ------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
            "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_tokenizer(smollm2_dir, tmp_path_factory) -> PromptTokenizer:
    """SmolLM2's tokenizer with a Qwen3-like template that branches on enable_thinking."""
    model_dir = tmp_path_factory.mktemp("thinking")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, model_dir / name)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    return PromptTokenizer.from_model_dir(model_dir)


def test_chat_template_kwargs_reach_the_template(thinking_tokenizer):
    thinking = thinking_tokenizer.render_chat([("user", "Hi")])
    plain = thinking_tokenizer.render_chat([("user", "Hi")], {"enable_thinking": False})
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # What the splitter makes of each prompt's end: reasoning first, or all answer.
    assert split("think", ["plan</think>ok", ""], thinking) == ("plan", "ok")
    assert split("think", ["ok", ""], plain) == ("", "ok")


async def test_generation_renders_the_kwargs_and_refuses_bad_ones(thinking_tokenizer):
    generation = Generation(thinking_tokenizer, replicas=None, metrics=None)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")],
                               chat_template_kwargs={"enable_thinking": "false"})
    prompt, _ = await generation.render_chat(messages)
    assert prompt.endswith("</think>\n\n")
    for kwargs, message in [({"enable_thinking": "nope"}, "chat_template_kwargs.enable_thinking: not a JSON value"),
                            ({"chat_template": '"x"'}, "chat_template cannot be set"),
                            ({"add_generation_prompt": "false"}, "add_generation_prompt cannot be set")]:
        bad = pb.ChatMessages(messages=messages.messages, chat_template_kwargs=kwargs)
        with pytest.raises(RequestError, match=message) as refused:
            await generation.render_chat(bad)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_delta_with_reasoning_and_answer_streams_as_two_chunks():
    from llmserve.router.openai.render import Renderer
    from llmserve.router.sample_stream import SampleDelta

    renderer = Renderer(chat=True, model="m", response_id="c", n=1, token_text=str)
    delta = SampleDelta(index=0, text="Hi", token_ids=[5], logprobs=[], finish_reason=FinishReason.STOP,
                        reasoning_text="plan")
    first, second = renderer.chunks(0, delta, first=True, with_logprobs=False)
    assert first["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "plan"}
    assert first["choices"][0]["finish_reason"] is None
    assert second["choices"][0]["delta"] == {"content": "Hi"} and second["choices"][0]["finish_reason"] == "stop"
    whole = renderer.completion({0: [delta]}, [], with_logprobs=False)["choices"][0]["message"]
    assert whole == {"role": "assistant", "reasoning_content": "plan", "content": "Hi"}


def test_grpc_clients_get_the_split_and_send_kwargs():
    from llmserve.client import GenerationDelta, build_generate_request
    from llmserve.router.sample_stream import SampleDelta
    from llmserve.router.service import GenerationServicer
    from llmserve.router.validation import check_known_fields

    delta = SampleDelta(index=0, text="Hi", token_ids=[5], logprobs=[], finish_reason=FinishReason.NONE,
                        reasoning_text="plan")
    response = GenerationServicer._response("r", delta)
    assert (response.reasoning_text, response.text) == ("plan", "Hi")
    assert GenerationDelta.from_pb(response).reasoning_text == "plan"
    request = build_generate_request(messages=[("user", "Hi")], chat_template_kwargs={"enable_thinking": False})
    assert dict(request.messages.chat_template_kwargs) == {"enable_thinking": "false"}
    check_known_fields(pb.GenerateRequest.FromString(request.SerializeToString()))  # A field this API knows.
