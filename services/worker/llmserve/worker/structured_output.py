"""Constrained decoding on the worker, with xgrammar: one GrammarMatcher per constrained
sample (RequestState.matcher), advanced by each token it samples; each step the
constrained rows' allowed tokens become a token bitmask ([C, ceil(V / 32)] int32, one
bit per token id, for the C constrained rows of the step's S) that the sampler applies
to those rows' logits before anything else.

    NewRequest (prompt + outputs so far) --matcher_for--> matcher, outputs replayed
    build_inputs --fill_bitmask--> SamplingRows.token_bitmask (None: no constrained row)
    Sampler: the constrained rows' logits of disallowed ids = -inf
    ModelRunner._run --RowGrammar.advance--> matcher.accept_token(sampled id)

A matcher whose grammar is complete allows only the model's eos ids (xgrammar's stop
tokens), so the sample ends there (the scheduler stops on eos); once it has accepted one
(terminated) the row is forced to eos every step, ignore_eos or not.

The tokenizer (TokenizerInfo) is loaded from the model directory at the first
constrained request: a worker that never sees one never pays for it. Compiled grammars
are cached per (kind, spec). NOTE: the model's vocab_size may exceed the tokenizer's
(padded embeddings): TokenizerInfo is built with the model's, so the bitmask covers
every logit and the padding ids are never allowed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
import xgrammar as xgr

from llmserve.contract.sampling import StructuredOutput
from llmserve.contract.structured_output import build_grammar
from llmserve.worker.sampler import TokenBitmask

logger = logging.getLogger(__name__)

MAX_COMPILED_GRAMMARS = 64


class Grammars:
    """The worker's grammar compiler for its model: compiled grammars cached per spec,
    and the matchers of constrained samples."""

    def __init__(self, model_dir: Path | str, vocab_size: int, eos_token_ids: Sequence[int]):
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compiled(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """so compiled against the model's tokenizer (cached: the last MAX_COMPILED_GRAMMARS
        specs). ValueError naming the problem if it is not a grammar."""
        with self._lock:
            hit = self._compiled.get(so)
            if hit is not None:
                self._compiled.move_to_end(so)
                return hit
            compiled = self._tokenizer_compiler().compile_grammar(build_grammar(so))
            self._compiled[so] = compiled
            if len(self._compiled) > MAX_COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled

    def matcher_for(self, so: StructuredOutput, output_token_ids: Sequence[int]) -> RowGrammar:
        """A new matcher that has accepted the sample's outputs so far (a preempted or
        re-sent sample resumes where it was)."""
        row = RowGrammar(xgr.GrammarMatcher(self.compiled(so)))
        for token_id in output_token_ids:
            row.advance(token_id)
        return row

    def fill_bitmask(self, grammars: Sequence[RowGrammar | None]) -> TokenBitmask:
        """The allowed ids of the rows i whose grammars[i] is not None (None: unconstrained,
        left out of the mask)."""
        rows = [i for i, row in enumerate(grammars) if row is not None]
        bits = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # [C, ceil(V / 32)]
        for j, i in enumerate(rows):
            row = grammars[i]
            if row.ended:
                self._only_eos(bits[j])
            else:
                row.matcher.fill_next_token_bitmask(bits, j)
        return TokenBitmask(torch.tensor(rows, dtype=torch.long), bits)

    def _only_eos(self, row: torch.Tensor) -> None:
        """row ([W] int32) allowing the first eos id only."""
        row.zero_()
        eos = self.eos_token_ids[0] if self.eos_token_ids else 0
        bit = 1 << (eos % 32)
        row[eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32: bit 31 is the sign


class RowGrammar:
    """One constrained sample's matcher, advanced by each token it samples."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher
        self.refused = False  # A sampled token the grammar did not allow: the row is ended.

    @property
    def ended(self) -> bool:
        """Nothing but eos may follow (the grammar accepted its stop token, or refused one)."""
        return self.refused or self.matcher.is_terminated()

    def advance(self, token_id: int) -> None:
        """After `token_id` was sampled. A token the grammar refuses (possible only where
        another setting, e.g. min_tokens masking eos, left no allowed token) ends the row."""
        if self.ended:
            return
        if not self.matcher.accept_token(token_id):
            logger.warning("structured output: sampled token %d is not allowed by the grammar; ending the sample",
                           token_id)
            self.refused = True
