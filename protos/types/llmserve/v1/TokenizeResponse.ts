// Original file: llmserve/v1/generation.proto


/**
 * The tokens `Generate` would see.
 */
export interface TokenizeResponse {
  /**
   * The token ids.
   */
  'token_ids'?: (number)[];
  /**
   * How many there are.
   */
  'count'?: (number);
  /**
   * For messages: the rendered chat template.
   */
  'prompt'?: (string);
}

/**
 * The tokens `Generate` would see.
 */
export interface TokenizeResponse__Output {
  /**
   * The token ids.
   */
  'token_ids': (number)[];
  /**
   * How many there are.
   */
  'count': (number);
  /**
   * For messages: the rendered chat template.
   */
  'prompt': (string);
}
