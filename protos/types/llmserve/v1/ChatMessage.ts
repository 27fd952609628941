// Original file: llmserve/v1/generation.proto

import type { ToolCall as _llmserve_v1_ToolCall, ToolCall__Output as _llmserve_v1_ToolCall__Output } from '../../llmserve/v1/ToolCall';

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
  /**
   * An assistant turn's calls of the request's tools (its earlier reply).
   */
  'tool_calls'?: (_llmserve_v1_ToolCall)[];
  /**
   * A "tool" turn: the id of the call whose result `content` is.
   */
  'tool_call_id'?: (string);
  /**
   * The author's name (a "tool" turn: the function's), passed to the template as is.
   */
  'name'?: (string);
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
  /**
   * An assistant turn's calls of the request's tools (its earlier reply).
   */
  'tool_calls': (_llmserve_v1_ToolCall__Output)[];
  /**
   * A "tool" turn: the id of the call whose result `content` is.
   */
  'tool_call_id': (string);
  /**
   * The author's name (a "tool" turn: the function's), passed to the template as is.
   */
  'name': (string);
}
