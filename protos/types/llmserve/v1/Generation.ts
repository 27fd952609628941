// Original file: llmserve/v1/generation.proto

import type * as grpc from '@grpc/grpc-js'
import type { MethodDefinition } from '@grpc/proto-loader'
import type { GenerateRequest as _llmserve_v1_GenerateRequest, GenerateRequest__Output as _llmserve_v1_GenerateRequest__Output } from '../../llmserve/v1/GenerateRequest';
import type { GenerateResponse as _llmserve_v1_GenerateResponse, GenerateResponse__Output as _llmserve_v1_GenerateResponse__Output } from '../../llmserve/v1/GenerateResponse';
import type { GetModelInfoRequest as _llmserve_v1_GetModelInfoRequest, GetModelInfoRequest__Output as _llmserve_v1_GetModelInfoRequest__Output } from '../../llmserve/v1/GetModelInfoRequest';
import type { ModelInfo as _llmserve_v1_ModelInfo, ModelInfo__Output as _llmserve_v1_ModelInfo__Output } from '../../llmserve/v1/ModelInfo';
import type { TokenizeRequest as _llmserve_v1_TokenizeRequest, TokenizeRequest__Output as _llmserve_v1_TokenizeRequest__Output } from '../../llmserve/v1/TokenizeRequest';
import type { TokenizeResponse as _llmserve_v1_TokenizeResponse, TokenizeResponse__Output as _llmserve_v1_TokenizeResponse__Output } from '../../llmserve/v1/TokenizeResponse';

/**
 * Text generation with the served model. The service name is part of every method
 * path on the wire, so it keeps its name (buf's SERVICE_SUFFIX is waived in buf.yaml).
 */
export interface GenerationClient extends grpc.Client {
  /**
   * Streams the completion of one prompt: one response per step per sample, the
   * last one of each sample carrying `finish_reason` and `usage`.
   */
  Generate(argument: _llmserve_v1_GenerateRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_llmserve_v1_GenerateResponse__Output>;
  Generate(argument: _llmserve_v1_GenerateRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_llmserve_v1_GenerateResponse__Output>;
  /**
   * Streams the completion of one prompt: one response per step per sample, the
   * last one of each sample carrying `finish_reason` and `usage`.
   */
  generate(argument: _llmserve_v1_GenerateRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_llmserve_v1_GenerateResponse__Output>;
  generate(argument: _llmserve_v1_GenerateRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_llmserve_v1_GenerateResponse__Output>;
  
  /**
   * What is being served: model, limits and KV cache geometry.
   */
  GetModelInfo(argument: _llmserve_v1_GetModelInfoRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  GetModelInfo(argument: _llmserve_v1_GetModelInfoRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  GetModelInfo(argument: _llmserve_v1_GetModelInfoRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  GetModelInfo(argument: _llmserve_v1_GetModelInfoRequest, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  /**
   * What is being served: model, limits and KV cache geometry.
   */
  getModelInfo(argument: _llmserve_v1_GetModelInfoRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  getModelInfo(argument: _llmserve_v1_GetModelInfoRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  getModelInfo(argument: _llmserve_v1_GetModelInfoRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  getModelInfo(argument: _llmserve_v1_GetModelInfoRequest, callback: grpc.requestCallback<_llmserve_v1_ModelInfo__Output>): grpc.ClientUnaryCall;
  
  /**
   * Turns text or chat messages into the token ids `Generate` would use.
   */
  Tokenize(argument: _llmserve_v1_TokenizeRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  Tokenize(argument: _llmserve_v1_TokenizeRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  Tokenize(argument: _llmserve_v1_TokenizeRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  Tokenize(argument: _llmserve_v1_TokenizeRequest, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  /**
   * Turns text or chat messages into the token ids `Generate` would use.
   */
  tokenize(argument: _llmserve_v1_TokenizeRequest, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  tokenize(argument: _llmserve_v1_TokenizeRequest, metadata: grpc.Metadata, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  tokenize(argument: _llmserve_v1_TokenizeRequest, options: grpc.CallOptions, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  tokenize(argument: _llmserve_v1_TokenizeRequest, callback: grpc.requestCallback<_llmserve_v1_TokenizeResponse__Output>): grpc.ClientUnaryCall;
  
}

/**
 * Text generation with the served model. The service name is part of every method
 * path on the wire, so it keeps its name (buf's SERVICE_SUFFIX is waived in buf.yaml).
 */
export interface GenerationHandlers extends grpc.UntypedServiceImplementation {
  /**
   * Streams the completion of one prompt: one response per step per sample, the
   * last one of each sample carrying `finish_reason` and `usage`.
   */
  Generate: grpc.handleServerStreamingCall<_llmserve_v1_GenerateRequest__Output, _llmserve_v1_GenerateResponse>;
  
  /**
   * What is being served: model, limits and KV cache geometry.
   */
  GetModelInfo: grpc.handleUnaryCall<_llmserve_v1_GetModelInfoRequest__Output, _llmserve_v1_ModelInfo>;
  
  /**
   * Turns text or chat messages into the token ids `Generate` would use.
   */
  Tokenize: grpc.handleUnaryCall<_llmserve_v1_TokenizeRequest__Output, _llmserve_v1_TokenizeResponse>;
  
}

export interface GenerationDefinition extends grpc.ServiceDefinition {
  Generate: MethodDefinition<_llmserve_v1_GenerateRequest, _llmserve_v1_GenerateResponse, _llmserve_v1_GenerateRequest__Output, _llmserve_v1_GenerateResponse__Output>
  GetModelInfo: MethodDefinition<_llmserve_v1_GetModelInfoRequest, _llmserve_v1_ModelInfo, _llmserve_v1_GetModelInfoRequest__Output, _llmserve_v1_ModelInfo__Output>
  Tokenize: MethodDefinition<_llmserve_v1_TokenizeRequest, _llmserve_v1_TokenizeResponse, _llmserve_v1_TokenizeRequest__Output, _llmserve_v1_TokenizeResponse__Output>
}
