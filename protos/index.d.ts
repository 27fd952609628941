// Types for index.js; the message and client types are generated (types/, npm run types).
import type * as grpc from '@grpc/grpc-js';
import type { Options } from '@grpc/proto-loader';
import type { ProtoGrpcType } from './types/generation';
import type { GenerationClient } from './types/llmserve/v1/Generation';

export type Api = ProtoGrpcType['llmserve']['v1'];
export type { GenerationClient } from './types/llmserve/v1/Generation';
export type { GenerateRequest } from './types/llmserve/v1/GenerateRequest';
export type { GenerateResponse__Output as GenerateResponse } from './types/llmserve/v1/GenerateResponse';
export type { SamplingParams } from './types/llmserve/v1/SamplingParams';
export type { ModelInfo__Output as ModelInfo } from './types/llmserve/v1/ModelInfo';
export type { TokenizeRequest } from './types/llmserve/v1/TokenizeRequest';
export type { TokenizeResponse__Output as TokenizeResponse } from './types/llmserve/v1/TokenizeResponse';
export type { FinishReason__Output as FinishReason } from './types/llmserve/v1/FinishReason';

export declare const PROTO_FILE: string;
export declare const LOADER_OPTIONS: Readonly<Options>;
export declare function loadApi(): Api;
export declare function createGenerationClient(
  address: string,
  credentials?: grpc.ChannelCredentials,
  options?: grpc.ClientOptions,
): GenerationClient;
