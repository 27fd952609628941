"""GGUF checkpoints: `--model FILE.gguf` serves the file's own weights (read tensor by
tensor from the file), tokenizer and chat template, with transformers' greedy tokens for
the same file; an architecture we do not run is refused in one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmserve import gguf_checkpoint, model_store
from llmserve.contract.sampling import SamplingParams
from llmserve.contract.startup_errors import StartupError, one_line
from llmserve.launcher.engine import InProcessEngine
from tests.tiny_gguf import write_llama_gguf
from tests.tiny_models import make_tiny_model

PROMPTS = {"raw": [5, 77, 140, 33, 260, 12, 9], "chat": None}  # "chat": the file's template, rendered below
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"F32" | "Q8_0": the GGUF file}, each alone in its directory, from one tiny Llama."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_tiny_model(root / "hf", "llama", True, seed=3)
    out = {}
    for kind in ("F32", "Q8_0"):
        (root / kind).mkdir()
        out[kind] = write_llama_gguf(hf_dir, root / kind / f"tiny-{kind.lower()}.gguf", kind)
    return out


@pytest.fixture(scope="module")
def model_dirs(files, tmp_path_factory):
    cache = tmp_path_factory.mktemp("gguf-cache")
    return {kind: gguf_checkpoint.gguf_model_dir(path, cache) for kind, path in files.items()}


def _prompts(model_dir) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    return {**PROMPTS, "chat": tok(chat, add_special_tokens=False)["input_ids"]}


def _transformers_greedy(gguf_path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """transformers loading the same GGUF (dequantized to float32), greedy, eos ignored."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        return {rid: hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for rid, p in prompts.items()}


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_greedy_tokens_match_transformers_on_the_same_file(kind, files, model_dirs):
    prompts = _prompts(model_dirs[kind])
    engine = InProcessEngine.from_model_dir(model_dirs[kind], dtype="float32", num_kv_blocks=32, block_size=16)
    ours = engine.run([(rid, p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
                       for rid, p in prompts.items()])
    assert {rid: out.output_token_ids for rid, out in ours.items()} == _transformers_greedy(files[kind], prompts)


def test_the_directory_holds_metadata_and_a_record_not_weights(files, model_dirs):
    d = model_dirs["Q8_0"]
    assert d.name == "tiny-q8_0" and not list(d.glob("*.safetensors"))
    record = gguf_checkpoint.read_record(d)
    assert record["gguf"] == str(files["Q8_0"].resolve()) and record["weights_in_gguf"]
    assert record["weight_type"] == "Q8_0" and record["tensor_types"] == {"Q8_0": 22, "F32": 7}
    assert gguf_checkpoint.quantized_weight_type(d) == "Q8_0"
    assert gguf_checkpoint.quantized_weight_type(model_dirs["F32"]) is None


def test_the_router_tokenizer_comes_from_the_file(model_dirs):
    from transformers import AutoTokenizer

    from llmserve.router.tokenizer import PromptTokenizer

    tok = PromptTokenizer.from_model_dir(model_dirs["F32"])
    assert tok.name == "tiny-f32" and tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    prompt, ids = tok.encode_chat([{"role": "user", "content": "Paris?"}])
    assert prompt == "<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n"
    reference = AutoTokenizer.from_pretrained(model_dirs["F32"])
    assert ids == reference(prompt, add_special_tokens=False)["input_ids"]


def test_q8_0_under_int8_is_requantized_per_row(model_dirs):
    """Our int8 layout has one scale per output row, Q8_0 one per 32 input columns: each row
    is requantized, moving a weight by at most half the row's step (max|row| / 254)."""
    from llmserve.worker.models.gguf_weights import iter_gguf
    from llmserve.worker.models.loader import load_config, load_model

    d = model_dirs["Q8_0"]
    config = load_config(d)
    wanted = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    q8 = dict(iter_gguf(gguf_checkpoint.gguf_weights(d), config, keep=wanted.__contains__))
    dequantized = torch.cat([q8[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])  # [q+k+v rows, hidden]
    model = load_model(d, "bfloat16", config, quantization="int8")
    int8 = model.model.layers[0].self_attn.qkv_proj.int8
    ours = int8.int8_rows().float() * int8.scale[:, None]
    step = dequantized.abs().amax(dim=1, keepdim=True) / 127
    assert ((ours - dequantized).abs() <= step / 2 + 1e-6).all()


def test_an_architecture_we_do_not_run_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(model_store, "cache_root", lambda: tmp_path / "cache")
    with pytest.raises(StartupError) as info:
        model_store.resolve_model_dir(str(path))
    assert one_line("worker", info.value) == (
        f"worker: --model {path}: unsupported GGUF architecture 'gpt2' (llmserve runs GGUF architectures "
        f"llama, qwen2; others as a Hugging Face directory of a supported architecture)")


def test_model_takes_a_file_or_a_directory_holding_one(files, tmp_path, monkeypatch):
    monkeypatch.setattr(model_store, "cache_root", lambda: tmp_path / "cache")
    by_file = model_store.resolve_model_dir(str(files["F32"]))
    assert model_store.resolve_model_dir(str(files["F32"].parent)) == by_file
    assert by_file.is_relative_to(tmp_path / "cache" / "gguf")
    two = tmp_path / "two"
    two.mkdir()
    for path in files.values():
        (two / path.name).symlink_to(path)
    with pytest.raises(StartupError, match=r"holds 2 GGUF files \(tiny-f32.gguf, tiny-q8_0.gguf\)"):
        model_store.resolve_model_dir(str(two))


def test_the_embedded_model_records_its_q4_1():
    try:
        d = model_store.default_model_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    record = gguf_checkpoint.read_record(d)
    assert record["weight_type"] == "Q4_1" and not record["weights_in_gguf"]  # (its dequantized copy is beside it)
    assert gguf_checkpoint.quantized_weight_type(d) == "Q4_1"
