// Original file: llmserve/v1/generation.proto

import type { TokenLogprobs as _llmserve_v1_TokenLogprobs, TokenLogprobs__Output as _llmserve_v1_TokenLogprobs__Output } from '../../llmserve/v1/TokenLogprobs';
import type { FinishReason as _llmserve_v1_FinishReason, FinishReason__Output as _llmserve_v1_FinishReason__Output } from '../../llmserve/v1/FinishReason';
import type { Usage as _llmserve_v1_Usage, Usage__Output as _llmserve_v1_Usage__Output } from '../../llmserve/v1/Usage';
import type { ToolCallDelta as _llmserve_v1_ToolCallDelta, ToolCallDelta__Output as _llmserve_v1_ToolCallDelta__Output } from '../../llmserve/v1/ToolCallDelta';

/**
 * One piece of the stream of one sample.
 */
export interface GenerateResponse {
  /**
   * The request's id (assigned by the router when the request left it empty).
   */
  'request_id'?: (string);
  /**
   * Which of the n samples, from 0.
   */
  'index'?: (number);
  /**
   * New text since the previous response of this sample (whole UTF-8 characters).
   */
  'text'?: (string);
  /**
   * New token ids since the previous response.
   */
  'token_ids'?: (number)[];
  /**
   * One per new token, when asked for.
   */
  'logprobs'?: (_llmserve_v1_TokenLogprobs)[];
  /**
   * Set on the sample's last response.
   */
  'finish_reason'?: (_llmserve_v1_FinishReason);
  /**
   * On the last response of the request.
   */
  'usage'?: (_llmserve_v1_Usage | null);
  /**
   * The stop string or token that ended it, if any.
   */
  'stop_reason'?: (string);
  /**
   * With FINISH_REASON_ERROR: what went wrong.
   */
  'error'?: (string);
  /**
   * A chat's new reasoning text, split from `text` by the router's --reasoning-parser
   * (e.g. what a model writes between <think> and </think>); empty without one.
   */
  'reasoning_text'?: (string);
  /**
   * A chat's tool calls, found by the --tool-call-parser (tool_choice auto) or
   * constrained (required, a named function): each call's first piece has its `id` and
   * `name`, later pieces extend its `arguments`.
   */
  'tool_calls'?: (_llmserve_v1_ToolCallDelta)[];
  /**
   * With SamplingParams.prompt_logprobs, on the sample's first response: the prompt's
   * tokens 1.. (the first token has none), each given the tokens before it.
   */
  'prompt_logprobs'?: (_llmserve_v1_TokenLogprobs)[];
}

/**
 * One piece of the stream of one sample.
 */
export interface GenerateResponse__Output {
  /**
   * The request's id (assigned by the router when the request left it empty).
   */
  'request_id': (string);
  /**
   * Which of the n samples, from 0.
   */
  'index': (number);
  /**
   * New text since the previous response of this sample (whole UTF-8 characters).
   */
  'text': (string);
  /**
   * New token ids since the previous response.
   */
  'token_ids': (number)[];
  /**
   * One per new token, when asked for.
   */
  'logprobs': (_llmserve_v1_TokenLogprobs__Output)[];
  /**
   * Set on the sample's last response.
   */
  'finish_reason': (_llmserve_v1_FinishReason__Output);
  /**
   * On the last response of the request.
   */
  'usage': (_llmserve_v1_Usage__Output | null);
  /**
   * The stop string or token that ended it, if any.
   */
  'stop_reason': (string);
  /**
   * With FINISH_REASON_ERROR: what went wrong.
   */
  'error': (string);
  /**
   * A chat's new reasoning text, split from `text` by the router's --reasoning-parser
   * (e.g. what a model writes between <think> and </think>); empty without one.
   */
  'reasoning_text': (string);
  /**
   * A chat's tool calls, found by the --tool-call-parser (tool_choice auto) or
   * constrained (required, a named function): each call's first piece has its `id` and
   * `name`, later pieces extend its `arguments`.
   */
  'tool_calls': (_llmserve_v1_ToolCallDelta__Output)[];
  /**
   * With SamplingParams.prompt_logprobs, on the sample's first response: the prompt's
   * tokens 1.. (the first token has none), each given the tokens before it.
   */
  'prompt_logprobs': (_llmserve_v1_TokenLogprobs__Output)[];
}
