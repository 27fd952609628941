"""A request's sampling settings: the one type every service uses for them.

The router converts the public API's settings (a gRPC `SamplingParams`, an OpenAI body)
into this once and resolves the defaults; the same record then travels to the scheduler
and on to the workers (one internal proto message, `llmserve.internal.v1.SamplingParams`,
converted in llmserve/contract/wire.py), and a worker turns it into per-row sampling
tensors (worker/sampler.py, `SamplingRows`).

Adding a setting: a field here; the same name in the internal message
(protos/llmserve/internal/v1/sampling.proto), the public one (protos/llmserve/v1/
generation.proto) and the OpenAI body (router/openai/protocol.py); one line in each
conversion (wire.py's three, the OpenAI body's one); its range check in
router/validation.py; a column in the worker's SamplingRows if the sampler reads it;
a value for it in tests/test_sampling_fields.py, which fails until each line exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Fields that never leave the router (not on the internal wire): the engine stops on
# token ids only; the router matches stop strings on the detokenized text, and turns bad
# words into bad_words_token_ids.
ROUTER_ONLY_FIELDS = frozenset({"stop", "bad_words"})
# Fields no client sets (not on the public API): the router fills them in from others.
ROUTER_RESOLVED_FIELDS = frozenset({"bad_words_token_ids"})


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: seed + index, wrapped into
    int64 (the seed's type on every wire), so seed 2**63 - 1 with n = 2 gives sample 1
    the seed -2**63 rather than a number no proto field can carry."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


# What StructuredOutput.spec holds for each kind (llmserve/contract/structured_output.py
# turns one into a grammar):
STRUCTURED_OUTPUT_KINDS = {
    "json_schema": "a JSON schema (JSON text); the output is JSON that validates against it",
    "json_object": "nothing (empty); the output is any JSON object",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON array of strings; the output is exactly one of them",
    "grammar": "an EBNF (GBNF) grammar whose rule `root` derives the output",
}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a sample's output: `kind` (a key of STRUCTURED_OUTPUT_KINDS) and its
    `spec` as text, so that one (kind, spec) pair keys every compilation cache."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    # None only between the router's front door and its validation: as many as fit
    # after the prompt. The scheduler and workers always see a number >= 1.
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0 means greedy.
    top_p: float = 1.0  # 1 means off.
    top_k: int = 0  # <= 0 means off (the router sends -1 as 0).
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: sampled token only; k: top k too.
    # The same for the prompt's tokens 1.. (each given the tokens before it); the prompt is
    # then computed in full (no prefix-cache hit).
    prompt_logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings never leave the router (ROUTER_ONLY_FIELDS).
    stop: tuple[str, ...] = field(default=())
    # Penalties, as vLLM defines them (worker/sampler.py applies them, in this order):
    # repetition over prompt + output tokens (a seen token's logit l becomes l / r if
    # l > 0, else l * r), then frequency and presence over output tokens only (l -= f *
    # count, l -= p * (count > 0)).
    repetition_penalty: float = 1.0  # 1 means off; > 1 discourages repeats.
    frequency_penalty: float = 0.0  # [-2, 2]; 0 means off.
    presence_penalty: float = 0.0  # [-2, 2]; 0 means off.
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the top one's; 0 means off.
    # (token id, bias) pairs, ids ascending: added to the logits before anything else.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # No eos, stop token id or stop string ends a sample before it has this many tokens.
    min_tokens: int = 0
    # Constrained decoding: only tokens the grammar allows are sampled, and a sample ends
    # (eos) once it is complete. None: unconstrained.
    structured_output: StructuredOutput | None = None
    # Words never generated (vLLM's bad_words). The router tokenizes each (as is and after
    # a space) into bad_words_token_ids: a sequence's last token is banned where the
    # output's last len - 1 tokens are the rest of it (a one-token sequence: always).
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the sampler reads the row's token history)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def matches_bad_word_prefixes(self) -> bool:
        """Whether a bad word has more than one token (its prefix is matched against the
        output's last tokens)."""
        return any(len(seq) > 1 for seq in self.bad_words_token_ids)

    @property
    def needs_history(self) -> bool:
        """Whether the sampler reads the row's token history: a penalty, or a bad word of
        more than one token."""
        return self.penalized or self.matches_bad_word_prefixes
