"""A three-process cluster (router, scheduler, worker: gRPC, TLS) whose worker runs on the
device: concurrent completions streamed through the router carry the tokens of the
in-process engine on the same device, and their text is the tokenizer's. The worker's own
log says where it ran: on CUDA, with its decode graphs captured."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.cluster import ClusterSpec, LocalCluster, free_port
from llmserve.launcher.engine import InProcessEngine
from tests.e2e.test_hf_equivalence import collect
from tests.tiny_models import TINY, make_tiny_model

from .conftest import DEVICE, GPU, ON_CUDA

pytestmark = [*GPU, pytest.mark.slow]

GEN = 16
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (5, 18, 1, 33)]
TEXT_PROMPT = "w5 w17 w42 w299"
# One step budget and graph ladder for the worker, the scheduler and the in-process engine.
RUNNER = dict(dtype="float32", num_kv_blocks=64, swap_space=0, max_num_batched_tokens=64, max_num_seqs=8)
GREEDY = dict(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: id i >= 3 is the word "w{i}"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"▁w{i}": i for i in range(3, TINY["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(model_dir)


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> Path:
    d = make_tiny_model(tmp_path_factory.mktemp("served-on-device"), "llama", True, seed=7, num_hidden_layers=4)
    write_tokenizer(d)
    return d


def _flags(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


async def test_cluster_on_device_streams_the_engine_tokens(served_model, tmp_path):
    from transformers import AutoTokenizer

    spec = ClusterSpec(
        model_dir=served_model, router_port=free_port(), scheduler_port=free_port(), worker_port=free_port(),
        worker_args=["--device", DEVICE.type, *_flags(RUNNER)],
        scheduler_args=_flags({k: RUNNER[k] for k in ("max_num_batched_tokens", "max_num_seqs")}), log_dir=tmp_path)
    cluster = LocalCluster(spec).start(timeout_s=240)
    try:
        async with cluster.client() as client:
            streams = [collect(client, token_ids=p, **GREEDY) for p in PROMPTS]
            streams.append(collect(client, prompt=TEXT_PROMPT, **GREEDY))
            results = await asyncio.gather(*streams)  # concurrent: they share decode steps
    finally:
        cluster.stop()

    tok = AutoTokenizer.from_pretrained(served_model)
    text_ids = tok(TEXT_PROMPT)["input_ids"]
    assert text_ids == [5, 17, 42, 299]
    engine = InProcessEngine.from_model_dir(served_model, device=DEVICE.type, **RUNNER)
    want = engine.run([(f"r{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate([*PROMPTS, text_ids])])
    for i, (ids, text) in enumerate(results):
        assert len(ids) == GEN and ids == want[f"r{i}"].output_token_ids, i
        assert text == tok.decode(ids, skip_special_tokens=True), i
    log = (tmp_path / "worker.log").read_text()
    where = f"({engine.runner.device}, float32, quantization none, {'CUDA graphs' if ON_CUDA else 'eager'})"
    assert "# KV blocks: 64" in log and where in log, log[-2000:]
