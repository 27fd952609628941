"""`llmserve bench moe`: decode tokens/s of a mixture-of-experts model beside a dense
model with the same *active* parameters per token, side by side in one run.

Both are random-weight checkpoints made on the spot from transformers' config classes
(no download); throughput depends on the shapes, not the values:
  moe:    Mixtral: `experts` experts of intermediate `expert_intermediate`, top `top_k`
  dense:  Llama: intermediate top_k * expert_intermediate; the same attention, layers,
          vocabulary, so a token multiplies by as many weights in both
The MoE model holds experts / top_k times the MLP weights; at batch 1 a step reads only
top_k experts' worth of them, at larger batches the tokens spread over more experts.
The timing is `decode_graphs.time_modes` (whole engine steps, the two models in turns).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from llmserve.bench.decode_graphs import SPARE_TOKENS, time_modes
from llmserve.bench.profile_step import decode_kv_blocks
from llmserve.bench.report import machine_info, save_report

PRESETS = {
    # ~13 M active parameters of MLP + attention; MLP weights of the MoE 4x the dense model's
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=4096, experts=8, expert_intermediate=384, top_k=2),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, experts=4, expert_intermediate=32, top_k=2),
}


def make_pair(out_dir: str | Path, preset: str = "small", seed: int = 0) -> dict:
    """Writes out_dir/moe and out_dir/dense; returns their directories and parameter counts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    p = dict(PRESETS[preset])
    experts, inter, top_k = p.pop("experts"), p.pop("expert_intermediate"), p.pop("top_k")
    common = dict(**p, max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    made = {}
    for name, model in (
        ("moe", lambda: MixtralForCausalLM(MixtralConfig(**common, intermediate_size=inter, num_local_experts=experts,
                                                         num_experts_per_tok=top_k))),
        ("dense", lambda: LlamaForCausalLM(LlamaConfig(**common, intermediate_size=top_k * inter))),
    ):
        torch.manual_seed(seed)
        m = model()
        total = sum(t.numel() for t in m.parameters())
        # active per token: everything but the experts not chosen
        expert_total = sum(t.numel() for n, t in m.named_parameters() if ".experts." in n)  # (0 for dense)
        active = total - expert_total * (experts - top_k) // experts
        d = Path(out_dir) / name
        m.save_pretrained(d)
        made[name] = {"dir": str(d), "parameters": total, "active_parameters": active}
    made["shape"] = {**PRESETS[preset]}
    return made


def compare_moe(made: dict, base, dtype: str, batches: list[int], context: int, steps: int) -> dict:
    """Per batch size: each model's median decode step (ms), tokens/s, and moe / dense."""
    from llmserve.worker.model_runner import ModelRunner

    blocks = decode_kv_blocks(max(batches), context, steps + SPARE_TOKENS, base.block_size)
    settings = replace(base, dtype=dtype, num_kv_blocks=blocks, swap_space=0, max_num_seqs=max(batches))
    runners = {name: ModelRunner(made[name]["dir"], settings) for name in ("moe", "dense")}
    rows = {}
    for batch in batches:
        seconds = time_modes(runners, batch, context, steps)
        rows[batch] = {**{f"{n}_step_ms": 1000 * s for n, s in seconds.items()},
                       **{f"{n}_tok_per_s": batch / s for n, s in seconds.items()},
                       "moe_over_dense_time": seconds["moe"] / seconds["dense"]}
    return {"device": str(runners["moe"].device), "dtype": dtype, "context": context, "steps": steps,
            "models": {n: made[n] for n in ("moe", "dense")}, "shape": made["shape"], "batches": rows}


def print_table(result: dict, cpu: str = "") -> None:
    moe, dense = result["models"]["moe"], result["models"]["dense"]
    where = f"{result['device']} ({cpu})" if cpu and result["device"] == "cpu" else result["device"]
    print(f"decode tok/s, {result['dtype']} on {where}, context {result['context']}, median of "
          f"{result['steps']} steps per cell; moe {moe['parameters'] / 1e6:.1f} M parameters "
          f"({moe['active_parameters'] / 1e6:.1f} M active), dense {dense['parameters'] / 1e6:.1f} M:", flush=True)
    print(f"{'batch':>5}  {'moe':>10}  {'dense':>10}  {'moe time / dense':>16}", flush=True)
    for batch, row in result["batches"].items():
        print(f"{batch:>5}  {row['moe_tok_per_s']:>10.1f}  {row['dense_tok_per_s']:>10.1f}  "
              f"{row['moe_over_dense_time']:>15.2f}x", flush=True)


def bench_moe(args) -> int:
    import tempfile

    from llmserve.worker.config import RunnerConfig

    with tempfile.TemporaryDirectory(prefix="llmserve-moe-bench-") as tmp:
        made = make_pair(tmp, args.preset, args.seed)
        result = compare_moe(made, RunnerConfig(), args.dtype, sorted(set(args.batch)), args.context, args.steps)
    machine = machine_info()
    print_table(result, f"{machine['cpu']}, {machine['torch_threads']} threads")
    report = {"kind": "moe", "machine": machine, "command": " ".join(args.argv), "preset": args.preset, **result}
    save_report(report, args.output_dir, f"moe-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0
