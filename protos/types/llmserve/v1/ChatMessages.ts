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
}

/**
 * A list of chat turns (a `oneof` cannot hold a repeated field directly).
 */
export interface ChatMessages__Output {
  /**
   * The conversation so far, oldest first.
   */
  'messages': (_llmserve_v1_ChatMessage__Output)[];
}
