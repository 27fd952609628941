// Original file: llmserve/v1/generation.proto

import type { ChatMessages as _llmserve_v1_ChatMessages, ChatMessages__Output as _llmserve_v1_ChatMessages__Output } from '../../llmserve/v1/ChatMessages';

/**
 * Text or chat messages to tokenize.
 */
export interface TokenizeRequest {
  /**
   * Empty: the served model. Any other name must match it (else NOT_FOUND).
   */
  'model'?: (string);
  /**
   * Raw text.
   */
  'text'?: (string);
  /**
   * Chat turns, rendered with the chat template (generation prompt added).
   */
  'messages'?: (_llmserve_v1_ChatMessages | null);
  /**
   * For `text`: add the tokenizer's special tokens (e.g. BOS). Unset: true.
   */
  'add_special_tokens'?: (boolean);
  /**
   * What to tokenize.
   */
  'input'?: "text"|"messages";
  '_add_special_tokens'?: "add_special_tokens";
}

/**
 * Text or chat messages to tokenize.
 */
export interface TokenizeRequest__Output {
  /**
   * Empty: the served model. Any other name must match it (else NOT_FOUND).
   */
  'model': (string);
  /**
   * Raw text.
   */
  'text'?: (string);
  /**
   * Chat turns, rendered with the chat template (generation prompt added).
   */
  'messages'?: (_llmserve_v1_ChatMessages__Output | null);
  /**
   * For `text`: add the tokenizer's special tokens (e.g. BOS). Unset: true.
   */
  'add_special_tokens'?: (boolean);
  /**
   * What to tokenize.
   */
  'input'?: "text"|"messages";
  '_add_special_tokens'?: "add_special_tokens";
}
