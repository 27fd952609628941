// Original file: llmserve/v1/generation.proto

import type { ChatMessage as _llmserve_v1_ChatMessage, ChatMessage__Output as _llmserve_v1_ChatMessage__Output } from '../../llmserve/v1/ChatMessage';
import type { Tool as _llmserve_v1_Tool, Tool__Output as _llmserve_v1_Tool__Output } from '../../llmserve/v1/Tool';
import type { ToolChoice as _llmserve_v1_ToolChoice, ToolChoice__Output as _llmserve_v1_ToolChoice__Output } from '../../llmserve/v1/ToolChoice';

/**
 * A list of chat turns (a `oneof` cannot hold a repeated field directly).
 */
export interface ChatMessages {
  /**
   * The conversation so far, oldest first.
   */
  'messages'?: (_llmserve_v1_ChatMessage)[];
  /**
   * Variables for the chat template (e.g. enable_thinking), each value a JSON text:
   * {"enable_thinking": "false"}. Not one of the template's own names (messages, tools,
   * add_generation_prompt, ...); a value that is not JSON is INVALID_ARGUMENT.
   */
  'chat_template_kwargs'?: ({[key: string]: string});
  /**
   * Functions the model may call; the chat template gets them as `tools`.
   */
  'tools'?: (_llmserve_v1_Tool)[];
  /**
   * How the model uses `tools`. Unset: auto with tools, none without.
   */
  'tool_choice'?: (_llmserve_v1_ToolChoice | null);
  /**
   * With tool_choice required: more than one call allowed. Unset: true.
   */
  'parallel_tool_calls'?: (boolean);
  '_parallel_tool_calls'?: "parallel_tool_calls";
}

/**
 * A list of chat turns (a `oneof` cannot hold a repeated field directly).
 */
export interface ChatMessages__Output {
  /**
   * The conversation so far, oldest first.
   */
  'messages': (_llmserve_v1_ChatMessage__Output)[];
  /**
   * Variables for the chat template (e.g. enable_thinking), each value a JSON text:
   * {"enable_thinking": "false"}. Not one of the template's own names (messages, tools,
   * add_generation_prompt, ...); a value that is not JSON is INVALID_ARGUMENT.
   */
  'chat_template_kwargs': ({[key: string]: string});
  /**
   * Functions the model may call; the chat template gets them as `tools`.
   */
  'tools': (_llmserve_v1_Tool__Output)[];
  /**
   * How the model uses `tools`. Unset: auto with tools, none without.
   */
  'tool_choice': (_llmserve_v1_ToolChoice__Output | null);
  /**
   * With tool_choice required: more than one call allowed. Unset: true.
   */
  'parallel_tool_calls'?: (boolean);
  '_parallel_tool_calls'?: "parallel_tool_calls";
}
