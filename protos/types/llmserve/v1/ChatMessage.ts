// Original file: llmserve/v1/generation.proto


/**
 * One turn of a chat, rendered with the model's chat template.
 */
export interface ChatMessage {
  /**
   * "system", "user", "assistant", ...
   */
  'role'?: (string);
  /**
   * The turn's text.
   */
  'content'?: (string);
}

/**
 * One turn of a chat, rendered with the model's chat template.
 */
export interface ChatMessage__Output {
  /**
   * "system", "user", "assistant", ...
   */
  'role': (string);
  /**
   * The turn's text.
   */
  'content': (string);
}
