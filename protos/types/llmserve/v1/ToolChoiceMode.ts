// Original file: llmserve/v1/generation.proto

/**
 * Whether and how the model calls tools.
 */
export const ToolChoiceMode = {
  /**
   * Unset: auto when the request has tools, else none.
   */
  TOOL_CHOICE_MODE_UNSPECIFIED: 'TOOL_CHOICE_MODE_UNSPECIFIED',
  /**
   * The model writes an answer; tools are shown to the template but its calls are not parsed.
   */
  TOOL_CHOICE_MODE_NONE: 'TOOL_CHOICE_MODE_NONE',
  /**
   * The model answers or calls tools; the router's --tool-call-parser finds the calls
   * (without one, INVALID_ARGUMENT).
   */
  TOOL_CHOICE_MODE_AUTO: 'TOOL_CHOICE_MODE_AUTO',
  /**
   * The model calls one or more tools: constrained decoding makes the output a JSON list
   * of calls whose arguments follow each tool's parameters schema.
   */
  TOOL_CHOICE_MODE_REQUIRED: 'TOOL_CHOICE_MODE_REQUIRED',
} as const;

/**
 * Whether and how the model calls tools.
 */
export type ToolChoiceMode =
  /**
   * Unset: auto when the request has tools, else none.
   */
  | 'TOOL_CHOICE_MODE_UNSPECIFIED'
  | 0
  /**
   * The model writes an answer; tools are shown to the template but its calls are not parsed.
   */
  | 'TOOL_CHOICE_MODE_NONE'
  | 1
  /**
   * The model answers or calls tools; the router's --tool-call-parser finds the calls
   * (without one, INVALID_ARGUMENT).
   */
  | 'TOOL_CHOICE_MODE_AUTO'
  | 2
  /**
   * The model calls one or more tools: constrained decoding makes the output a JSON list
   * of calls whose arguments follow each tool's parameters schema.
   */
  | 'TOOL_CHOICE_MODE_REQUIRED'
  | 3

/**
 * Whether and how the model calls tools.
 */
export type ToolChoiceMode__Output = typeof ToolChoiceMode[keyof typeof ToolChoiceMode]
