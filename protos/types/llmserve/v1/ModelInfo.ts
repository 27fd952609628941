// Original file: llmserve/v1/generation.proto


/**
 * The served model and the engine's limits.
 */
export interface ModelInfo {
  /**
   * The served model's name.
   */
  'model'?: (string);
  /**
   * Prompt + completion tokens, at most.
   */
  'max_model_len'?: (number);
  /**
   * Size of the model's vocabulary (token ids are below it).
   */
  'vocab_size'?: (number);
  /**
   * Token ids that end generation unless ignore_eos is set.
   */
  'eos_token_ids'?: (number)[];
  /**
   * The weights' dtype: "float32", "bfloat16", ...
   */
  'dtype'?: (string);
  /**
   * Tokens per KV cache block.
   */
  'block_size'?: (number);
  /**
   * KV cache blocks the schedulers manage, over all data-parallel replicas serving.
   */
  'num_kv_blocks'?: (number);
  /**
   * Tensor-parallel ranks the model is split over.
   */
  'tensor_parallel_size'?: (number);
  /**
   * The tokenizer's beginning-of-sequence token id.
   */
  'bos_token_id'?: (number);
  /**
   * Where the model runs: "cpu", or "cuda (<GPU name>)".
   */
  'device'?: (string);
  /**
   * Decode steps replay CUDA graphs (off: eager, or not on CUDA).
   */
  'cuda_graphs'?: (boolean);
  /**
   * Data-parallel replicas (a scheduler and its workers each) serving now behind this router.
   */
  'data_parallel_size'?: (number);
  /**
   * Weight quantization: "none", "int8" (int8 linear projections, one scale per output
   * row; on CPUs with AVX-512 VNNI their input activations are quantized too, one scale
   * per 64 columns: W8A8) or "int8-weight-only"; embeddings and the LM head keep `dtype`.
   */
  'quantization'?: (string);
  /**
   * Why `dtype`: --dtype auto's choice and its grounds (the checkpoint's dtype, the CPU's
   * instruction sets, a measurement), or "--dtype" when it was given.
   */
  'dtype_reason'?: (string);
  /**
   * Most tokens one engine step computes (prompts longer than this are split into
   * chunks): the scheduler's --max-num-batched-tokens, or the default for its device.
   */
  'max_num_batched_tokens'?: (number);
  /**
   * Most sequences one engine step runs (--max-num-seqs, or the default for the device).
   */
  'max_num_seqs'?: (number);
  /**
   * Why these two: "by device: cuda (<GPU name>), 79.6 GiB", "by device: cpu", or
   * "set by --max-num-seqs" and the like when given.
   */
  'step_budget_reason'?: (string);
}

/**
 * The served model and the engine's limits.
 */
export interface ModelInfo__Output {
  /**
   * The served model's name.
   */
  'model': (string);
  /**
   * Prompt + completion tokens, at most.
   */
  'max_model_len': (number);
  /**
   * Size of the model's vocabulary (token ids are below it).
   */
  'vocab_size': (number);
  /**
   * Token ids that end generation unless ignore_eos is set.
   */
  'eos_token_ids': (number)[];
  /**
   * The weights' dtype: "float32", "bfloat16", ...
   */
  'dtype': (string);
  /**
   * Tokens per KV cache block.
   */
  'block_size': (number);
  /**
   * KV cache blocks the schedulers manage, over all data-parallel replicas serving.
   */
  'num_kv_blocks': (number);
  /**
   * Tensor-parallel ranks the model is split over.
   */
  'tensor_parallel_size': (number);
  /**
   * The tokenizer's beginning-of-sequence token id.
   */
  'bos_token_id': (number);
  /**
   * Where the model runs: "cpu", or "cuda (<GPU name>)".
   */
  'device': (string);
  /**
   * Decode steps replay CUDA graphs (off: eager, or not on CUDA).
   */
  'cuda_graphs': (boolean);
  /**
   * Data-parallel replicas (a scheduler and its workers each) serving now behind this router.
   */
  'data_parallel_size': (number);
  /**
   * Weight quantization: "none", "int8" (int8 linear projections, one scale per output
   * row; on CPUs with AVX-512 VNNI their input activations are quantized too, one scale
   * per 64 columns: W8A8) or "int8-weight-only"; embeddings and the LM head keep `dtype`.
   */
  'quantization': (string);
  /**
   * Why `dtype`: --dtype auto's choice and its grounds (the checkpoint's dtype, the CPU's
   * instruction sets, a measurement), or "--dtype" when it was given.
   */
  'dtype_reason': (string);
  /**
   * Most tokens one engine step computes (prompts longer than this are split into
   * chunks): the scheduler's --max-num-batched-tokens, or the default for its device.
   */
  'max_num_batched_tokens': (number);
  /**
   * Most sequences one engine step runs (--max-num-seqs, or the default for the device).
   */
  'max_num_seqs': (number);
  /**
   * Why these two: "by device: cuda (<GPU name>), 79.6 GiB", "by device: cpu", or
   * "set by --max-num-seqs" and the like when given.
   */
  'step_budget_reason': (string);
}
