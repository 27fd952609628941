// Original file: llmserve/v1/generation.proto

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
  '_max_tokens'?: "max_tokens";
  '_temperature'?: "temperature";
  '_top_p'?: "top_p";
  '_seed'?: "seed";
  '_n'?: "n";
  '_logprobs'?: "logprobs";
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
  '_max_tokens'?: "max_tokens";
  '_temperature'?: "temperature";
  '_top_p'?: "top_p";
  '_seed'?: "seed";
  '_n'?: "n";
  '_logprobs'?: "logprobs";
}
