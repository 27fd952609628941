"""Structured output as the official `openai` SDK uses it, through the real cluster:
`chat.completions.parse(response_format=Model)` sends the pydantic model as a strict
json_schema (`additionalProperties: false`, every field required) and parses the reply
back into the model; `chat.completions.stream(response_format=Model)` does the same over
SSE. Greedy decoding of the tiny embedded model under each grammar must end by itself
(eos, finish_reason "stop": the SDK refuses a truncated reply) with JSON that both
pydantic and `jsonschema` accept.

NOTE: string and array lengths are bounded (maxLength, maxItems): nothing else stops a
135M model that repeats itself inside a string."""

from __future__ import annotations

import json
from enum import Enum
from typing import Literal, Optional

import jsonschema
import pytest
from pydantic import BaseModel, Field

from .test_openai_api import MODEL, sdk


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


class Weather(BaseModel):
    city: str = Field(max_length=40)
    temperature_c: float = Field(ge=-90, le=60)
    condition: Literal["sunny", "cloudy", "rainy", "snowy"]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    email: Optional[str] = Field(max_length=60)  # Required, but may be null.


class Recipe(BaseModel):
    title: str = Field(max_length=40)
    ingredients: list[str] = Field(min_length=1, max_length=4)
    minutes: int = Field(ge=1, le=600)


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=40)
    postcode: str = Field(max_length=10)


class Customer(BaseModel):
    name: str = Field(max_length=40)
    address: Address
    vip: bool


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):
    color: Color
    glossy: bool
    litres: float = Field(ge=0, le=100)


class Item(BaseModel):
    name: str = Field(max_length=30)
    quantity: int = Field(ge=1, le=99)
    price: float = Field(ge=0, le=10_000)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    total: float = Field(ge=0, le=100_000)
    paid: bool


class Book(BaseModel):
    title: str = Field(max_length=50)
    author: str = Field(max_length=40)
    year: int = Field(ge=1000, le=2100)
    genres: list[Literal["fiction", "science", "history", "poetry"]] = Field(max_length=3)
    rating: Optional[float] = Field(ge=0, le=5)


class Leg(BaseModel):
    origin: str = Field(max_length=30)
    destination: str = Field(max_length=30)


class Trip(BaseModel):
    outbound: Leg
    back: Optional[Leg]  # A nested object or null.
    stops: int = Field(ge=0, le=5)
    meal: Optional[Literal["vegetarian", "standard"]]


class Step(BaseModel):
    order: int = Field(ge=1, le=20)
    action: str = Field(max_length=40)
    done: bool


class Plan(BaseModel):
    goal: str = Field(max_length=40)
    steps: list[Step] = Field(min_length=1, max_length=3)


CASES = [
    (City, "Describe the capital of France as JSON."),
    (Weather, "Give today's weather in London as JSON."),
    (Person, "Invent a person and describe them as JSON."),
    (Recipe, "Give a simple pancake recipe as JSON."),
    (Customer, "Describe a customer who lives in Paris as JSON."),
    (Paint, "Describe a tin of red paint as JSON."),
    (Order, "Describe an order of two books as JSON."),
    (Book, "Describe the novel Dune as JSON."),
    (Trip, "Describe a return flight from Paris to Rome as JSON."),
    (Plan, "Plan how to make tea, as JSON."),
]
# Enough for the longest reply (Plan: ~140 tokens); finishing sooner is the model's eos.
MAX_TOKENS = 400


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def assert_valid(model: type[BaseModel], content: str, parsed, finish_reason: str) -> None:
    """The reply ended by itself, and its JSON is valid against the model's schema (jsonschema's
    verdict, not ours) and is what the SDK parsed."""
    assert finish_reason == "stop", content
    assert isinstance(parsed, model), content
    document = json.loads(content)
    jsonschema.validate(document, model.model_json_schema())
    assert model.model_validate(document) == parsed


@pytest.mark.slow
@pytest.mark.parametrize("model, question", CASES, ids=[m.__name__ for m, _ in CASES])
async def test_parse_returns_the_model(cluster, model, question):
    async with sdk(cluster) as client:
        reply = await client.chat.completions.parse(model=MODEL, messages=_messages(question), response_format=model,
                                                    temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.message.parsed is not None and choice.message.refusal is None
    assert_valid(model, choice.message.content, choice.message.parsed, choice.finish_reason)


@pytest.mark.slow
@pytest.mark.parametrize("model, question", [CASES[i] for i in (1, 4, 6, 8)],
                         ids=[CASES[i][0].__name__ for i in (1, 4, 6, 8)])
async def test_stream_parses_the_model_and_equals_parse(cluster, model, question):
    async with sdk(cluster) as client:
        async with client.chat.completions.stream(model=MODEL, messages=_messages(question), response_format=model,
                                                  temperature=0, max_tokens=MAX_TOKENS) as stream:
            deltas = [event.delta async for event in stream if event.type == "content.delta"]
            final = await stream.get_final_completion()
        whole = await client.chat.completions.parse(model=MODEL, messages=_messages(question), response_format=model,
                                                    temperature=0, max_tokens=MAX_TOKENS)
    choice = final.choices[0]
    assert len(deltas) > 1 and "".join(deltas) == choice.message.content  # Streamed in pieces.
    assert_valid(model, choice.message.content, choice.message.parsed, choice.finish_reason)
    assert choice.message.content == whole.choices[0].message.content  # Greedy: the same reply.
