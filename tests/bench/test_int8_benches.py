"""`bench decode-variants` and `bench quality` on a tiny random model: the figures they
report are there and consistent."""

from __future__ import annotations

import random

import pytest

from llmserve.bench.decode_variants import compare_variants, step_bytes
from llmserve.bench.quality import Variant, evaluate, stdlib_docstrings
from llmserve.worker.config import RunnerConfig


def test_decode_variants_time_every_variant_at_every_batch(tiny_llama_dir):
    result = compare_variants(tiny_llama_dir, RunnerConfig(), ["float32", "bfloat16", "int8"], [1, 3], context=8,
                              steps=2)
    assert result["variants"]["int8"] == {"dtype": "bfloat16", "quantization": "int8"}
    for batch in (1, 3):
        row = result["batches"][batch]
        assert row["bfloat16"]["over_bfloat16"] == 1.0 and row["bfloat16"]["roofline_over_bfloat16"] == 1.0
        assert row["int8"]["roofline_over_bfloat16"] > 1.0 > row["float32"]["roofline_over_bfloat16"]
        for cell in row.values():
            assert cell["tok_per_s"] == pytest.approx(batch / (cell["step_ms"] / 1000))


def test_step_bytes_count_int8_weights_as_one_byte_and_the_kv_cache_as_it_is():
    from types import SimpleNamespace

    # 2 layers, hidden 64, MLP 128, 4 heads of 16 (2 for K/V), vocab 256.
    config = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=256, head_dim=16)
    linear = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)  # q, k, v, o, gate, up, down
    head = 256 * 64
    kv = 2 * 2 * 32 * 3 * 10  # K and V, 2 layers, 32 columns, 3 sequences of 10 tokens
    assert step_bytes(config, "bfloat16", 3, 10) == 2 * (linear + head + kv)
    assert step_bytes(config, "int8", 3, 10) == linear + head + 2 * kv  # the LM head in int8 too
    assert step_bytes(config, "int8-wo", 3, 10) == linear + 2 * head + 2 * kv
    assert step_bytes(config, "float32", 3, 10) == 4 * (linear + head + kv)


def test_quality_is_measured_against_float32(tiny_llama_dir):
    tokens = [random.Random(1).randrange(300) for _ in range(80)]
    rows = evaluate(tiny_llama_dir, [Variant("bfloat16", "int8-weight-only"), Variant("bfloat16", "int8")], tokens)
    assert list(rows) == ["float32", "int8-weight-only (bfloat16)", "int8 (bfloat16)"]
    assert rows["float32"]["agreement_with_float32"] == 1.0 and rows["float32"]["perplexity_change"] == 0.0
    weight_only, w8a8 = rows["int8-weight-only (bfloat16)"], rows["int8 (bfloat16)"]
    assert 0.8 <= weight_only["agreement_with_float32"] <= 1.0 and abs(weight_only["perplexity_change"]) < 0.1
    # W8A8 where the CPU has VNNI: this random model's 64-wide rows are a single activation
    # group each (one scale per token), which costs it ~11% perplexity (SmolLM2: +1.0%).
    assert 0.8 <= w8a8["agreement_with_float32"] <= 1.0 and abs(w8a8["perplexity_change"]) < 0.2


def test_the_text_is_long_english_and_fixed():
    text = stdlib_docstrings()
    assert text == stdlib_docstrings() and len(text.split()) > 3000
    assert text.startswith("JSON (JavaScript Object Notation)")


def test_profile_times_every_piece_of_a_decode_step(tiny_llama_dir):
    from llmserve.bench.profile_step import profile_decode_step

    report = profile_decode_step(tiny_llama_dir, "float32", batch=3, context=12, reps=2)
    assert set(report["pieces_s"]) >= {"scheduler: schedule()", "model forward (profiled)", "sampling",
                                       "scheduler: update_from_output()"}
    assert all(seconds > 0 for seconds in report["pieces_s"].values())
    assert report["forward_ops_s"] and report["plan_bytes"] > 0


def test_the_layerwise_floor_adds_the_products_and_attention_bounds():
    """One decode step whose products are compute-bound and whose attention is
    memory-bound: the roofline floor overlaps them, the layer-by-layer floor adds them."""
    from types import SimpleNamespace

    import torch

    from llmserve.bench.flops import ModelBytes, ModelFlops
    from llmserve.bench.throughput import roofline

    config = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=256, head_dim=16)
    step = SimpleNamespace(num_scheduled_tokens=8, num_sampled=8, attention_pairs=8 * 100, kv_tokens_read=8 * 100)
    engine = SimpleNamespace(runner=SimpleNamespace(config=config), steps=[step])
    flops, model_bytes = ModelFlops.from_config(config), ModelBytes.from_config(config, torch.bfloat16)
    peak, bandwidth = 4e9, 1e9
    products = flops.product_flops(8, 8) / peak  # > the weights' bytes / bandwidth
    attention = model_bytes.kv_bytes(8, 800) / bandwidth  # > its FLOPs / peak
    assert products > model_bytes.weight_bytes(8) / bandwidth and attention > flops.attention_flops(800) / peak
    got = roofline(engine, peak, bandwidth, torch.bfloat16, {"seconds": 1.0, "model_tflop": 1e-6})
    assert got["layerwise_floor_seconds"] == pytest.approx(products + attention)
    assert got["roofline_floor_seconds"] == pytest.approx(max(flops.step_flops(8, 8, 800) / peak,
                                                              model_bytes.step_bytes(8, 8, 800) / bandwidth))
    assert got["roofline_floor_seconds"] < got["layerwise_floor_seconds"]
