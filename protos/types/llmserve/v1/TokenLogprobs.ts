// Original file: llmserve/v1/generation.proto


/**
 * A token's logprob and the most likely alternatives at its position.
 */
export interface TokenLogprobs {
  /**
   * The sampled token.
   */
  'token_id'?: (number);
  /**
   * Its log-probability under the model (before sampling filters).
   */
  'logprob'?: (number | string);
  /**
   * Most likely tokens, best first.
   */
  'top_token_ids'?: (number)[];
  /**
   * Their log-probabilities, parallel to top_token_ids.
   */
  'top_logprobs'?: (number | string)[];
  /**
   * The token's rank among the whole vocabulary's log-probabilities (1: the most likely).
   */
  'rank'?: (number);
}

/**
 * A token's logprob and the most likely alternatives at its position.
 */
export interface TokenLogprobs__Output {
  /**
   * The sampled token.
   */
  'token_id': (number);
  /**
   * Its log-probability under the model (before sampling filters).
   */
  'logprob': (number);
  /**
   * Most likely tokens, best first.
   */
  'top_token_ids': (number)[];
  /**
   * Their log-probabilities, parallel to top_token_ids.
   */
  'top_logprobs': (number)[];
  /**
   * The token's rank among the whole vocabulary's log-probabilities (1: the most likely).
   */
  'rank': (number);
}
