// Original file: llmserve/v1/generation.proto

import type { ToolChoiceMode as _llmserve_v1_ToolChoiceMode, ToolChoiceMode__Output as _llmserve_v1_ToolChoiceMode__Output } from '../../llmserve/v1/ToolChoiceMode';

/**
 * `tool_choice`: a mode, or one function the model must call.
 */
export interface ToolChoice {
  /**
   * none, auto or required.
   */
  'mode'?: (_llmserve_v1_ToolChoiceMode);
  /**
   * Call this function (one of the tools) once: the whole output is its arguments,
   * constrained to its parameters schema.
   */
  'function_name'?: (string);
  /**
   * Exactly one of the two.
   */
  'choice'?: "mode"|"function_name";
}

/**
 * `tool_choice`: a mode, or one function the model must call.
 */
export interface ToolChoice__Output {
  /**
   * none, auto or required.
   */
  'mode'?: (_llmserve_v1_ToolChoiceMode__Output);
  /**
   * Call this function (one of the tools) once: the whole output is its arguments,
   * constrained to its parameters schema.
   */
  'function_name'?: (string);
  /**
   * Exactly one of the two.
   */
  'choice'?: "mode"|"function_name";
}
