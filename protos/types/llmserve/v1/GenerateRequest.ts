// Original file: llmserve/v1/generation.proto

import type { TokenIds as _llmserve_v1_TokenIds, TokenIds__Output as _llmserve_v1_TokenIds__Output } from '../../llmserve/v1/TokenIds';
import type { ChatMessages as _llmserve_v1_ChatMessages, ChatMessages__Output as _llmserve_v1_ChatMessages__Output } from '../../llmserve/v1/ChatMessages';
import type { SamplingParams as _llmserve_v1_SamplingParams, SamplingParams__Output as _llmserve_v1_SamplingParams__Output } from '../../llmserve/v1/SamplingParams';

/**
 * One prompt to complete.
 */
export interface GenerateRequest {
  /**
   * Assigned by the router when empty. Must be unique among running requests.
   */
  'request_id'?: (string);
  /**
   * Empty: the served model. Any other name must match it (else NOT_FOUND).
   */
  'model'?: (string);
  /**
   * A raw prompt, tokenized with the model's tokenizer.
   */
  'text'?: (string);
  /**
   * Already tokenized.
   */
  'token_ids'?: (_llmserve_v1_TokenIds | null);
  /**
   * Rendered with the chat template, generation prompt added.
   */
  'messages'?: (_llmserve_v1_ChatMessages | null);
  /**
   * Sampling and stopping; unset means the defaults of SamplingParams.
   */
  'params'?: (_llmserve_v1_SamplingParams | null);
  /**
   * Scheduling priority: lower values are served first and may preempt higher ones.
   * Equal priorities are served first come, first served. Default 0.
   */
  'priority'?: (number);
  /**
   * Prefix-cache isolation (vLLM's cache_salt): the request reuses cached KV blocks only
   * of requests that gave the same salt, so one tenant cannot learn another's prompts
   * from how fast theirs are served. Give each tenant a secret, unguessable salt (e.g. 32
   * random bytes, base64). Empty: unsalted, shared with every unsalted request. At most
   * 1,024 bytes.
   */
  'cache_salt'?: (string);
  /**
   * The prompt, in exactly one of three forms.
   */
  'input'?: "text"|"token_ids"|"messages";
}

/**
 * One prompt to complete.
 */
export interface GenerateRequest__Output {
  /**
   * Assigned by the router when empty. Must be unique among running requests.
   */
  'request_id': (string);
  /**
   * Empty: the served model. Any other name must match it (else NOT_FOUND).
   */
  'model': (string);
  /**
   * A raw prompt, tokenized with the model's tokenizer.
   */
  'text'?: (string);
  /**
   * Already tokenized.
   */
  'token_ids'?: (_llmserve_v1_TokenIds__Output | null);
  /**
   * Rendered with the chat template, generation prompt added.
   */
  'messages'?: (_llmserve_v1_ChatMessages__Output | null);
  /**
   * Sampling and stopping; unset means the defaults of SamplingParams.
   */
  'params': (_llmserve_v1_SamplingParams__Output | null);
  /**
   * Scheduling priority: lower values are served first and may preempt higher ones.
   * Equal priorities are served first come, first served. Default 0.
   */
  'priority': (number);
  /**
   * Prefix-cache isolation (vLLM's cache_salt): the request reuses cached KV blocks only
   * of requests that gave the same salt, so one tenant cannot learn another's prompts
   * from how fast theirs are served. Give each tenant a secret, unguessable salt (e.g. 32
   * random bytes, base64). Empty: unsalted, shared with every unsalted request. At most
   * 1,024 bytes.
   */
  'cache_salt': (string);
  /**
   * The prompt, in exactly one of three forms.
   */
  'input'?: "text"|"token_ids"|"messages";
}
