// Original file: llmserve/v1/generation.proto

/**
 * What a constrained sample's output must be.
 */
export const StructuredOutputKind = {
  /**
   * Not a valid kind (refused).
   */
  STRUCTURED_OUTPUT_KIND_UNSPECIFIED: 'STRUCTURED_OUTPUT_KIND_UNSPECIFIED',
  /**
   * JSON that validates against the JSON schema in `spec` (JSON text).
   */
  STRUCTURED_OUTPUT_KIND_JSON_SCHEMA: 'STRUCTURED_OUTPUT_KIND_JSON_SCHEMA',
  /**
   * Any JSON object; `spec` is empty.
   */
  STRUCTURED_OUTPUT_KIND_JSON_OBJECT: 'STRUCTURED_OUTPUT_KIND_JSON_OBJECT',
  /**
   * Text the regular expression in `spec` matches in full.
   */
  STRUCTURED_OUTPUT_KIND_REGEX: 'STRUCTURED_OUTPUT_KIND_REGEX',
  /**
   * Exactly one of the strings of the JSON array in `spec`.
   */
  STRUCTURED_OUTPUT_KIND_CHOICE: 'STRUCTURED_OUTPUT_KIND_CHOICE',
  /**
   * Text the EBNF (GBNF) grammar in `spec` derives from its rule `root`.
   */
  STRUCTURED_OUTPUT_KIND_GRAMMAR: 'STRUCTURED_OUTPUT_KIND_GRAMMAR',
} as const;

/**
 * What a constrained sample's output must be.
 */
export type StructuredOutputKind =
  /**
   * Not a valid kind (refused).
   */
  | 'STRUCTURED_OUTPUT_KIND_UNSPECIFIED'
  | 0
  /**
   * JSON that validates against the JSON schema in `spec` (JSON text).
   */
  | 'STRUCTURED_OUTPUT_KIND_JSON_SCHEMA'
  | 1
  /**
   * Any JSON object; `spec` is empty.
   */
  | 'STRUCTURED_OUTPUT_KIND_JSON_OBJECT'
  | 2
  /**
   * Text the regular expression in `spec` matches in full.
   */
  | 'STRUCTURED_OUTPUT_KIND_REGEX'
  | 3
  /**
   * Exactly one of the strings of the JSON array in `spec`.
   */
  | 'STRUCTURED_OUTPUT_KIND_CHOICE'
  | 4
  /**
   * Text the EBNF (GBNF) grammar in `spec` derives from its rule `root`.
   */
  | 'STRUCTURED_OUTPUT_KIND_GRAMMAR'
  | 5

/**
 * What a constrained sample's output must be.
 */
export type StructuredOutputKind__Output = typeof StructuredOutputKind[keyof typeof StructuredOutputKind]
