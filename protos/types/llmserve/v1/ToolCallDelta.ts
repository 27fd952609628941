// Original file: llmserve/v1/generation.proto


/**
 * A piece of one tool call of a streamed reply.
 */
export interface ToolCallDelta {
  /**
   * Which call of the sample, from 0.
   */
  'index'?: (number);
  /**
   * The call's id, in its first piece only.
   */
  'id'?: (string);
  /**
   * The function's name, in its first piece only.
   */
  'name'?: (string);
  /**
   * More of the arguments' JSON text: a call's pieces joined are its whole arguments.
   */
  'arguments'?: (string);
}

/**
 * A piece of one tool call of a streamed reply.
 */
export interface ToolCallDelta__Output {
  /**
   * Which call of the sample, from 0.
   */
  'index': (number);
  /**
   * The call's id, in its first piece only.
   */
  'id': (string);
  /**
   * The function's name, in its first piece only.
   */
  'name': (string);
  /**
   * More of the arguments' JSON text: a call's pieces joined are its whole arguments.
   */
  'arguments': (string);
}
