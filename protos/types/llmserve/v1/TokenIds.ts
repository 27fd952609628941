// Original file: llmserve/v1/generation.proto


/**
 * Pre-tokenized input.
 */
export interface TokenIds {
  /**
   * Token ids of the model's vocabulary, each in [0, vocab_size).
   */
  'ids'?: (number)[];
}

/**
 * Pre-tokenized input.
 */
export interface TokenIds__Output {
  /**
   * Token ids of the model's vocabulary, each in [0, vocab_size).
   */
  'ids': (number)[];
}
