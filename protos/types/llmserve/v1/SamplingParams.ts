// Original file: llmserve/v1/generation.proto

import type { StructuredOutput as _llmserve_v1_StructuredOutput, StructuredOutput__Output as _llmserve_v1_StructuredOutput__Output } from '../../llmserve/v1/StructuredOutput';
import type { Long } from '@grpc/proto-loader';

/**
 * How to sample a completion. Every field has a default, so an empty message means
 * one sample, temperature 1.0, as long as the context allows.
 */
export interface SamplingParams {
  /**
   * Most tokens to generate. Unset: as many as fit in max_model_len.
   */
  'max_tokens'?: (number);
  /**
   * 0 means greedy. Unset: 1.0.
   */
  'temperature'?: (number | string);
  /**
   * Nucleus sampling mass in (0, 1]. Unset: 1.0 (off).
   */
  'top_p'?: (number | string);
  /**
   * Keep the k most likely tokens; 0 or -1 means off.
   */
  'top_k'?: (number);
  /**
   * Makes sampling reproducible whatever else runs in the same batch.
   */
  'seed'?: (number | string | Long);
  /**
   * Generation stops before any of these strings; the string is not returned.
   */
  'stop'?: (string)[];
  /**
   * Keep generating past end-of-sequence tokens.
   */
  'ignore_eos'?: (boolean);
  /**
   * Number of samples for the prompt; each streams with its own `index`. Unset: 1.
   */
  'n'?: (number);
  /**
   * Top logprobs to return per token. Unset: none; 0: only the sampled token's.
   */
  'logprobs'?: (number);
  /**
   * Extra token ids that end generation (besides the model's eos ids).
   */
  'stop_token_ids'?: (number)[];
  /**
   * Divides (a positive logit) or multiplies (a negative one) the logit of every token
   * already in the prompt or the output; > 1 discourages repeats. Unset: 1.0 (off).
   */
  'repetition_penalty'?: (number | string);
  /**
   * Subtracted from a token's logit once per time it occurs in the output (not the
   * prompt); in [-2, 2], 0 is off.
   */
  'frequency_penalty'?: (number | string);
  /**
   * Subtracted from a token's logit if it occurs in the output (not the prompt) at all;
   * in [-2, 2], 0 is off.
   */
  'presence_penalty'?: (number | string);
  /**
   * Drops tokens whose probability (after temperature) is below min_p times the most
   * likely token's; in [0, 1], 0 is off.
   */
  'min_p'?: (number | string);
  /**
   * Token id -> bias in [-100, 100], added to that token's logit before any other
   * setting applies (+100 all but forces a token, -100 all but bans it).
   */
  'logit_bias'?: ({[key: number]: number | string});
  /**
   * No eos token, stop token id or stop string ends a sample before it has this many
   * tokens. At most max_tokens.
   */
  'min_tokens'?: (number);
  /**
   * Constrained decoding: only tokens the grammar allows are sampled, and the sample
   * ends once the grammar is complete. Unset: unconstrained. A spec that cannot be
   * compiled is refused with INVALID_ARGUMENT before anything is queued.
   */
  'structured_output'?: (_llmserve_v1_StructuredOutput | null);
  /**
   * Words never generated (vLLM's bad_words): each is tokenized as is and after a space,
   * and a sequence's last token is banned wherever the output so far ends with the rest
   * of it (a one-token word: everywhere). At most 128 words of 256 bytes each.
   */
  'bad_words'?: (string)[];
  /**
   * Logprobs of the prompt's tokens, each given the tokens before it (the first token has
   * none), with this many most likely tokens each; in [0, 20]. Returned on each sample's
   * first response (GenerateResponse.prompt_logprobs). Unset: none. The prompt is then
   * computed in full: no prefix-cache hit.
   */
  'prompt_logprobs'?: (number);
  '_max_tokens'?: "max_tokens";
  '_temperature'?: "temperature";
  '_top_p'?: "top_p";
  '_seed'?: "seed";
  '_n'?: "n";
  '_logprobs'?: "logprobs";
  '_repetition_penalty'?: "repetition_penalty";
  '_prompt_logprobs'?: "prompt_logprobs";
}

/**
 * How to sample a completion. Every field has a default, so an empty message means
 * one sample, temperature 1.0, as long as the context allows.
 */
export interface SamplingParams__Output {
  /**
   * Most tokens to generate. Unset: as many as fit in max_model_len.
   */
  'max_tokens'?: (number);
  /**
   * 0 means greedy. Unset: 1.0.
   */
  'temperature'?: (number);
  /**
   * Nucleus sampling mass in (0, 1]. Unset: 1.0 (off).
   */
  'top_p'?: (number);
  /**
   * Keep the k most likely tokens; 0 or -1 means off.
   */
  'top_k': (number);
  /**
   * Makes sampling reproducible whatever else runs in the same batch.
   */
  'seed'?: (string);
  /**
   * Generation stops before any of these strings; the string is not returned.
   */
  'stop': (string)[];
  /**
   * Keep generating past end-of-sequence tokens.
   */
  'ignore_eos': (boolean);
  /**
   * Number of samples for the prompt; each streams with its own `index`. Unset: 1.
   */
  'n'?: (number);
  /**
   * Top logprobs to return per token. Unset: none; 0: only the sampled token's.
   */
  'logprobs'?: (number);
  /**
   * Extra token ids that end generation (besides the model's eos ids).
   */
  'stop_token_ids': (number)[];
  /**
   * Divides (a positive logit) or multiplies (a negative one) the logit of every token
   * already in the prompt or the output; > 1 discourages repeats. Unset: 1.0 (off).
   */
  'repetition_penalty'?: (number);
  /**
   * Subtracted from a token's logit once per time it occurs in the output (not the
   * prompt); in [-2, 2], 0 is off.
   */
  'frequency_penalty': (number);
  /**
   * Subtracted from a token's logit if it occurs in the output (not the prompt) at all;
   * in [-2, 2], 0 is off.
   */
  'presence_penalty': (number);
  /**
   * Drops tokens whose probability (after temperature) is below min_p times the most
   * likely token's; in [0, 1], 0 is off.
   */
  'min_p': (number);
  /**
   * Token id -> bias in [-100, 100], added to that token's logit before any other
   * setting applies (+100 all but forces a token, -100 all but bans it).
   */
  'logit_bias': ({[key: number]: number});
  /**
   * No eos token, stop token id or stop string ends a sample before it has this many
   * tokens. At most max_tokens.
   */
  'min_tokens': (number);
  /**
   * Constrained decoding: only tokens the grammar allows are sampled, and the sample
   * ends once the grammar is complete. Unset: unconstrained. A spec that cannot be
   * compiled is refused with INVALID_ARGUMENT before anything is queued.
   */
  'structured_output': (_llmserve_v1_StructuredOutput__Output | null);
  /**
   * Words never generated (vLLM's bad_words): each is tokenized as is and after a space,
   * and a sequence's last token is banned wherever the output so far ends with the rest
   * of it (a one-token word: everywhere). At most 128 words of 256 bytes each.
   */
  'bad_words': (string)[];
  /**
   * Logprobs of the prompt's tokens, each given the tokens before it (the first token has
   * none), with this many most likely tokens each; in [0, 20]. Returned on each sample's
   * first response (GenerateResponse.prompt_logprobs). Unset: none. The prompt is then
   * computed in full: no prefix-cache hit.
   */
  'prompt_logprobs'?: (number);
  '_max_tokens'?: "max_tokens";
  '_temperature'?: "temperature";
  '_top_p'?: "top_p";
  '_seed'?: "seed";
  '_n'?: "n";
  '_logprobs'?: "logprobs";
  '_repetition_penalty'?: "repetition_penalty";
  '_prompt_logprobs'?: "prompt_logprobs";
}
