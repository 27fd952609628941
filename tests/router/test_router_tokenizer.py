from __future__ import annotations

import json
import shutil

import pytest

from llmserve.router.tokenizer import PromptTokenizer


def test_encode_text_has_no_bos_for_smollm2(smollm2):
    assert smollm2.encode_text("Hello world") == [19556, 905]
    assert smollm2.decode([19556, 905]) == "Hello world"


def test_encode_chat_matches_apply_chat_template(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt, ids = smollm2.encode_chat(messages)
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    # SmolLM2's template adds a default system turn when there is none.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    expected = smollm2.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    if hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding.
        expected = expected["input_ids"]
    assert ids == list(expected)
    # The template writes <|im_start|> (id 1) itself: exactly once per turn, no extra BOS.
    assert ids[0] == 1 and ids[1] != 1
    assert ids.count(1) == 3  # system, user, assistant


def test_encode_chat_accepts_tuples(smollm2):
    with_tuples = smollm2.encode_chat([("system", "Be brief."), ("user", "Hi")])
    with_dicts = smollm2.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert with_tuples == with_dicts
    assert with_tuples[0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_ids_and_special_tokens(smollm2):
    assert smollm2.eos_token_ids == (2,)
    assert smollm2.bos_token_id == 1
    assert smollm2.vocab_size == 49152
    assert smollm2.tokenizer_vocab_size == 49152
    # All added special tokens, not only bos/eos/unk (decode skips them all).
    assert smollm2.special_token_ids == frozenset(range(17))
    ids = smollm2.encode_text("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert all(0 <= i < smollm2.vocab_size for i in ids)


def _copy_model_dir(src, dst, *, drop_template=False, config_eos=None, gen_eos=None):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    if not drop_template:
        shutil.copy(src / "chat_template.jinja", dst / "chat_template.jinja")
    for name, eos in (("config.json", config_eos), ("generation_config.json", gen_eos)):
        if eos is not None:
            data = json.loads((dst / name).read_text())
            data["eos_token_id"] = eos
            (dst / name).write_text(json.dumps(data))
    return dst


def test_no_chat_template_is_a_clear_error(smollm2_dir, tmp_path):
    tok = PromptTokenizer.from_model_dir(_copy_model_dir(smollm2_dir, tmp_path, drop_template=True))
    assert tok.encode_text("Hello world") == [19556, 905]
    with pytest.raises(ValueError, match=f"model {tmp_path.name} has no chat template"):
        tok.encode_chat([("user", "Hi")])
    with pytest.raises(ValueError, match="has no chat template"):
        tok.render_chat([("user", "Hi")])


def test_eos_ids_union_of_tokenizer_and_configs(smollm2_dir, tmp_path):
    tok = PromptTokenizer.from_model_dir(
        _copy_model_dir(smollm2_dir, tmp_path, config_eos=[2, 0], gen_eos=7)
    )
    assert tok.eos_token_ids == (0, 2, 7)


def test_bad_messages_rejected(smollm2):
    with pytest.raises(ValueError):
        smollm2.render_chat([])
    with pytest.raises(ValueError):
        smollm2.render_chat([{"role": "user"}])


def test_longest_token_bytes_bounds_bytes_per_token(smollm2):
    # A newline and 80 spaces is SmolLM2's longest token; +1 for decoders that drop a space.
    longest = smollm2.longest_token_bytes()
    assert longest == 82
    for text in ("\n" + " " * 80, "=" * 10_000, " " * 10_000, "def f():\n" + " " * 200 + "return 1"):
        assert len(text.encode()) <= longest * len(smollm2.encode_text(text, add_special_tokens=False))


def test_bad_words_are_tokenized_as_is_and_after_a_space(smollm2):
    hf = smollm2.tokenizer  # The reference: the HF tokenizer itself, without special tokens.
    got = smollm2.bad_words_token_ids(["Paris", "  New York"])
    want = [tuple(hf.encode(text, add_special_tokens=False)) for text in ("Paris", " Paris", "New York", " New York")]
    assert got == tuple(want)
    assert len(set(got)) == 4 and any(len(seq) > 1 for seq in got)  # Spelled apart; a multi-token word.
    assert smollm2.bad_words_token_ids(["Paris", "Paris"]) == tuple(want[:2])  # Each sequence once.
