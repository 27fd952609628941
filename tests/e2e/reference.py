"""HF transformers as the reference we did not write: same weights, float32, greedy."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Our requests use ignore_eos: the reference must not stop at eos either. (min_new_tokens
    # would not do: it masks eos out of the logits, which changes the greedy choice.)
    model.generation_config.eos_token_id = None
    return model.eval()


@functools.lru_cache(maxsize=1)
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF `generate`, greedy, eos ignored (generation runs the full length).

    Returns the new token ids and, per step, the log-softmax over the vocabulary.
    """
    from transformers import GenerationConfig

    model = hf_model(model_dir)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,  # Raw logits, before any logits processor.
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    new_ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]
    return new_ids, logprobs
