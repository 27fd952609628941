// Original file: llmserve/v1/generation.proto


/**
 * A call of a tool, as a client sends it back in an assistant turn.
 */
export interface ToolCall {
  /**
   * The call's id ("call_..."), which the tool turn answering it repeats.
   */
  'id'?: (string);
  /**
   * The function called.
   */
  'name'?: (string);
  /**
   * Its arguments, a JSON object as text.
   */
  'arguments'?: (string);
}

/**
 * A call of a tool, as a client sends it back in an assistant turn.
 */
export interface ToolCall__Output {
  /**
   * The call's id ("call_..."), which the tool turn answering it repeats.
   */
  'id': (string);
  /**
   * The function called.
   */
  'name': (string);
  /**
   * Its arguments, a JSON object as text.
   */
  'arguments': (string);
}
