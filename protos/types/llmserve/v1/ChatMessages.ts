// Original file: llmserve/v1/generation.proto

import type { ChatMessage as _llmserve_v1_ChatMessage, ChatMessage__Output as _llmserve_v1_ChatMessage__Output } from '../../llmserve/v1/ChatMessage';

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
}
