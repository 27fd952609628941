from __future__ import annotations

import random

import pytest

from llmserve.router.detokenizer import IncrementalDetokenizer, StreamDetokenizer, new_detokenizer

FFFD = "\ufffd"

TEXTS = [
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Family: 👩‍👩‍👧 and 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, thumbs 👍🏽 done.",
    "Crème brûlée, naïve façade, Ærøskøbing, Straße, jalapeño, ŽŠČ.",
    "def f(x):\n    if x:\n        return  x * 2\n\n\treturn None\n  # trailing  \n",
    "Numbers: 3.14159, 1,000,000, -42, 0x1F, 2024-11-21, 12345678901234567890.",
    "  leading spaces, Mixed 中文 and English, emoji 🎉 at end 🎉",
    "Ελληνικά, русский текст, العربية, हिन्दी, 한국어 텍스트, 日本語のテキスト",
]


@pytest.fixture(params=["window", "decode_stream"])
def make(request):
    """Both detokenizers meet every behavioural test: the Python window (the fallback) and
    tokenizers' DecodeStream (what the router uses for a tokenizer with a Rust backend)."""

    def build(tokenizer, skip_special_tokens=True):
        if request.param == "window":
            return IncrementalDetokenizer(tokenizer, skip_special_tokens)
        detok = new_detokenizer(tokenizer, skip_special_tokens)
        assert isinstance(detok, StreamDetokenizer)
        return detok

    return build


def _stream(detok, ids, chunk_sizes):
    deltas = []
    i = 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        deltas.append(detok.push(ids[i:i + size]))
        i += size
    while i < len(ids):
        deltas.append(detok.push(ids[i:i + 1]))
        i += 1
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(smollm2, text, make):
    ids = smollm2.encode_text(text)
    assert smollm2.decode(ids) == text  # The texts round-trip through this tokenizer.
    detok = make(smollm2)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any(FFFD in d for d in deltas)
    assert deltas[-1] == ""  # Valid text: nothing left to flush.


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks(smollm2, text, make):
    ids = smollm2.encode_text(text)
    rng = random.Random(len(text))
    for _ in range(20):
        detok = make(smollm2)
        deltas = _stream(detok, ids, [rng.randint(1, 7) for _ in ids])
        assert "".join(deltas) == text
        assert not any(FFFD in d for d in deltas)


def test_multibyte_characters_are_held_back(smollm2, make):
    # 👩 is split over byte-level tokens: nothing may be emitted until it is whole.
    ids = smollm2.encode_text("a👩")
    assert len(ids) >= 3
    detok = make(smollm2)
    assert detok.push(ids[:1]) == "a"
    assert [detok.push([i]) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert detok.push(ids[-1:]) == "👩"
    assert detok.flush() == ""


def test_unfinished_character_is_flushed_as_decode_does(smollm2, make):
    ids = smollm2.encode_text("ok 你")[:-1]  # Cut inside 你.
    detok = make(smollm2)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "ok "
    assert smollm2.decode(ids) == "ok " + FFFD
    assert detok.flush() == FFFD
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(smollm2, make):
    ids = smollm2.encode_text("<|im_start|>assistant\nHi there<|im_end|><repo_name>")
    assert ids[0] == 1 and ids[-2:] == [2, 3]
    for skip in (True, False):
        detok = make(smollm2, skip_special_tokens=skip)
        deltas = [detok.push([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == smollm2.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas).endswith("Hi there<|im_end|><repo_name>")


def test_random_token_ids(smollm2, make):
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randint(1, 40))]
        expected = smollm2.decode(ids)
        for chunked in (False, True):
            detok = make(smollm2)
            sizes = [rng.randint(1, 5) if chunked else 1 for _ in ids]
            deltas = _stream(detok, ids, sizes)
            assert "".join(deltas) == expected, ids
            if FFFD not in expected:
                assert not any(FFFD in d for d in deltas), ids


def _byte_token(smollm2, byte: int) -> int:
    """The id of the byte-level token for one raw byte (GPT-2 byte-to-unicode map)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = [b for b in range(256) if b not in visible]
    char = chr(byte) if byte in visible else chr(256 + extra.index(byte))
    return smollm2.tokenizer.convert_tokens_to_ids(char)


def test_invalid_bytes_do_not_hold_the_window_open(smollm2):
    # A long run of lone UTF-8 continuation bytes: every one is U+FFFD for good.
    cont = _byte_token(smollm2, 0xA9)
    first = _byte_token(smollm2, 0xF0)
    assert smollm2.decode([cont]) == FFFD
    ids = ([first] + [cont] * 50 + smollm2.encode_text(" ok")) * 20
    detok = IncrementalDetokenizer(smollm2)
    deltas = []
    for i in ids:
        deltas.append(detok.push([i]))
        assert detok.window_size <= 12
    deltas.append(detok.flush())
    assert "".join(deltas) == smollm2.decode(ids)


def test_window_stays_bounded_on_long_text(smollm2):
    ids = smollm2.encode_text("The quick brown fox 🦊 jumps over 懒狗. " * 200)
    detok = IncrementalDetokenizer(smollm2)
    biggest = 0
    for i in ids:
        detok.push([i])
        biggest = max(biggest, detok.window_size)
    assert biggest <= 8
    assert detok.flush() == ""


def _sentencepiece_like():
    """A Llama-style tokenizer: '▁' for spaces, the first token's space stripped,
    byte-fallback tokens for characters outside the vocabulary."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    words = ["▁Hello", "▁world", "▁", "world", "Hello", "!", "▁!", ",", "▁the", "the", "▁▁", "\n"]
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    pieces = [[vocab[w]] for w in words] + [[1], [2]]
    pieces += [[vocab[f"<0x{b:02X}>"] for b in ch.encode()] for ch in "你é👩\u200d"]
    return hf, vocab, pieces


def test_leading_space_stripping_tokenizer(make):
    hf, vocab, pieces = _sentencepiece_like()
    ids = [vocab["▁Hello"], vocab["▁world"], vocab["!"]]
    # Decoded alone, "▁world" loses its space; the stream must keep it.
    assert hf.decode(ids[1:2]) == "world"
    detok = make(hf)
    assert [detok.push([i]) for i in ids] == ["Hello", " world", "!"]
    rng = random.Random(1)
    for _ in range(500):
        ids = [i for _ in range(rng.randint(1, 20)) for i in rng.choice(pieces)]
        detok = make(hf)
        deltas = _stream(detok, ids, [rng.randint(1, 3) for _ in ids])
        assert "".join(deltas) == hf.decode(ids, skip_special_tokens=True), ids
        assert not any(FFFD in d for d in deltas), ids


def test_decode_stream_gives_invalid_bytes_out_once_text_follows(smollm2):
    cont, first = _byte_token(smollm2, 0xA9), _byte_token(smollm2, 0xF0)
    ids = ([first] + [cont] * 50 + smollm2.encode_text(" ok")) * 5
    detok = new_detokenizer(smollm2)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == smollm2.decode(ids)
    assert detok.window_size == 0


def test_a_tokenizer_without_a_rust_backend_gets_the_window(smollm2):
    class PythonOnly:  # decode() only, as a slow tokenizer offers
        def decode(self, ids, skip_special_tokens=True):
            return smollm2.decode(ids, skip_special_tokens)

    assert isinstance(new_detokenizer(PythonOnly()), IncrementalDetokenizer)
