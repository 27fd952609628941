// Original file: llmserve/v1/generation.proto


/**
 * A function the model may call.
 */
export interface Tool {
  /**
   * The function's name: letters, digits, '_' and '-', at most 64.
   */
  'name'?: (string);
  /**
   * What it does, for the model.
   */
  'description'?: (string);
  /**
   * Its parameters: a JSON schema as text (an object's). Empty: it takes none.
   */
  'parameters'?: (string);
}

/**
 * A function the model may call.
 */
export interface Tool__Output {
  /**
   * The function's name: letters, digits, '_' and '-', at most 64.
   */
  'name': (string);
  /**
   * What it does, for the model.
   */
  'description': (string);
  /**
   * Its parameters: a JSON schema as text (an object's). Empty: it takes none.
   */
  'parameters': (string);
}
