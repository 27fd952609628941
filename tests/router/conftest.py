from __future__ import annotations

import pytest

from llmserve.model_store import default_model_dir
from llmserve.router.tokenizer import PromptTokenizer


@pytest.fixture(scope="session")
def smollm2_dir():
    return default_model_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir) -> PromptTokenizer:
    return PromptTokenizer.from_model_dir(smollm2_dir)
