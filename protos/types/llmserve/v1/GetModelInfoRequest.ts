// Original file: llmserve/v1/generation.proto


/**
 * Asks what is being served.
 */
export interface GetModelInfoRequest {
  /**
   * Empty: the served model. Any other name must match it (else NOT_FOUND).
   */
  'model'?: (string);
}

/**
 * Asks what is being served.
 */
export interface GetModelInfoRequest__Output {
  /**
   * Empty: the served model. Any other name must match it (else NOT_FOUND).
   */
  'model': (string);
}
