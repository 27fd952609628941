// Original file: llmserve/v1/generation.proto

/**
 * Why a sample ended. The values carry the enum's name as a prefix, so that they
 * cannot collide with C/C++ macros (Windows defines ERROR); the numbers are what
 * travels on the wire.
 */
export const FinishReason = {
  /**
   * Still running.
   */
  FINISH_REASON_UNSPECIFIED: 'FINISH_REASON_UNSPECIFIED',
  /**
   * An eos token, a stop token id or a stop string.
   */
  FINISH_REASON_STOP: 'FINISH_REASON_STOP',
  /**
   * max_tokens or max_model_len reached.
   */
  FINISH_REASON_LENGTH: 'FINISH_REASON_LENGTH',
  /**
   * Cancelled (client or server shut down).
   */
  FINISH_REASON_ABORT: 'FINISH_REASON_ABORT',
  /**
   * Failed; see `error`.
   */
  FINISH_REASON_ERROR: 'FINISH_REASON_ERROR',
  /**
   * Ended (as STOP would) after calling tools; see `tool_calls`.
   */
  FINISH_REASON_TOOL_CALLS: 'FINISH_REASON_TOOL_CALLS',
} as const;

/**
 * Why a sample ended. The values carry the enum's name as a prefix, so that they
 * cannot collide with C/C++ macros (Windows defines ERROR); the numbers are what
 * travels on the wire.
 */
export type FinishReason =
  /**
   * Still running.
   */
  | 'FINISH_REASON_UNSPECIFIED'
  | 0
  /**
   * An eos token, a stop token id or a stop string.
   */
  | 'FINISH_REASON_STOP'
  | 1
  /**
   * max_tokens or max_model_len reached.
   */
  | 'FINISH_REASON_LENGTH'
  | 2
  /**
   * Cancelled (client or server shut down).
   */
  | 'FINISH_REASON_ABORT'
  | 3
  /**
   * Failed; see `error`.
   */
  | 'FINISH_REASON_ERROR'
  | 4
  /**
   * Ended (as STOP would) after calling tools; see `tool_calls`.
   */
  | 'FINISH_REASON_TOOL_CALLS'
  | 5

/**
 * Why a sample ended. The values carry the enum's name as a prefix, so that they
 * cannot collide with C/C++ macros (Windows defines ERROR); the numbers are what
 * travels on the wire.
 */
export type FinishReason__Output = typeof FinishReason[keyof typeof FinishReason]
