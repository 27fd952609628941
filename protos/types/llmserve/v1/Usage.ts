// Original file: llmserve/v1/generation.proto


/**
 * Token counts of a finished request.
 */
export interface Usage {
  /**
   * Tokens in the prompt.
   */
  'prompt_tokens'?: (number);
  /**
   * Tokens generated, over all samples.
   */
  'completion_tokens'?: (number);
  /**
   * Prompt tokens whose KV came from the prefix cache.
   */
  'cached_tokens'?: (number);
}

/**
 * Token counts of a finished request.
 */
export interface Usage__Output {
  /**
   * Tokens in the prompt.
   */
  'prompt_tokens': (number);
  /**
   * Tokens generated, over all samples.
   */
  'completion_tokens': (number);
  /**
   * Prompt tokens whose KV came from the prefix cache.
   */
  'cached_tokens': (number);
}
