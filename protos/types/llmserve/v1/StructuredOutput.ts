// Original file: llmserve/v1/generation.proto

import type { StructuredOutputKind as _llmserve_v1_StructuredOutputKind, StructuredOutputKind__Output as _llmserve_v1_StructuredOutputKind__Output } from '../../llmserve/v1/StructuredOutputKind';

/**
 * A grammar the output must follow.
 */
export interface StructuredOutput {
  /**
   * Which kind of grammar `spec` is.
   */
  'kind'?: (_llmserve_v1_StructuredOutputKind);
  /**
   * The grammar as text (see each kind).
   */
  'spec'?: (string);
}

/**
 * A grammar the output must follow.
 */
export interface StructuredOutput__Output {
  /**
   * Which kind of grammar `spec` is.
   */
  'kind': (_llmserve_v1_StructuredOutputKind__Output);
  /**
   * The grammar as text (see each kind).
   */
  'spec': (string);
}
