import type * as grpc from '@grpc/grpc-js';
import type { EnumTypeDefinition, MessageTypeDefinition } from '@grpc/proto-loader';

import type { ChatMessage as _llmserve_v1_ChatMessage, ChatMessage__Output as _llmserve_v1_ChatMessage__Output } from './llmserve/v1/ChatMessage';
import type { ChatMessages as _llmserve_v1_ChatMessages, ChatMessages__Output as _llmserve_v1_ChatMessages__Output } from './llmserve/v1/ChatMessages';
import type { GenerateRequest as _llmserve_v1_GenerateRequest, GenerateRequest__Output as _llmserve_v1_GenerateRequest__Output } from './llmserve/v1/GenerateRequest';
import type { GenerateResponse as _llmserve_v1_GenerateResponse, GenerateResponse__Output as _llmserve_v1_GenerateResponse__Output } from './llmserve/v1/GenerateResponse';
import type { GenerationClient as _llmserve_v1_GenerationClient, GenerationDefinition as _llmserve_v1_GenerationDefinition } from './llmserve/v1/Generation';
import type { GetModelInfoRequest as _llmserve_v1_GetModelInfoRequest, GetModelInfoRequest__Output as _llmserve_v1_GetModelInfoRequest__Output } from './llmserve/v1/GetModelInfoRequest';
import type { ModelInfo as _llmserve_v1_ModelInfo, ModelInfo__Output as _llmserve_v1_ModelInfo__Output } from './llmserve/v1/ModelInfo';
import type { SamplingParams as _llmserve_v1_SamplingParams, SamplingParams__Output as _llmserve_v1_SamplingParams__Output } from './llmserve/v1/SamplingParams';
import type { StructuredOutput as _llmserve_v1_StructuredOutput, StructuredOutput__Output as _llmserve_v1_StructuredOutput__Output } from './llmserve/v1/StructuredOutput';
import type { TokenIds as _llmserve_v1_TokenIds, TokenIds__Output as _llmserve_v1_TokenIds__Output } from './llmserve/v1/TokenIds';
import type { TokenLogprobs as _llmserve_v1_TokenLogprobs, TokenLogprobs__Output as _llmserve_v1_TokenLogprobs__Output } from './llmserve/v1/TokenLogprobs';
import type { TokenizeRequest as _llmserve_v1_TokenizeRequest, TokenizeRequest__Output as _llmserve_v1_TokenizeRequest__Output } from './llmserve/v1/TokenizeRequest';
import type { TokenizeResponse as _llmserve_v1_TokenizeResponse, TokenizeResponse__Output as _llmserve_v1_TokenizeResponse__Output } from './llmserve/v1/TokenizeResponse';
import type { Tool as _llmserve_v1_Tool, Tool__Output as _llmserve_v1_Tool__Output } from './llmserve/v1/Tool';
import type { ToolCall as _llmserve_v1_ToolCall, ToolCall__Output as _llmserve_v1_ToolCall__Output } from './llmserve/v1/ToolCall';
import type { ToolCallDelta as _llmserve_v1_ToolCallDelta, ToolCallDelta__Output as _llmserve_v1_ToolCallDelta__Output } from './llmserve/v1/ToolCallDelta';
import type { ToolChoice as _llmserve_v1_ToolChoice, ToolChoice__Output as _llmserve_v1_ToolChoice__Output } from './llmserve/v1/ToolChoice';
import type { Usage as _llmserve_v1_Usage, Usage__Output as _llmserve_v1_Usage__Output } from './llmserve/v1/Usage';

type SubtypeConstructor<Constructor extends new (...args: any) => any, Subtype> = {
  new(...args: ConstructorParameters<Constructor>): Subtype;
};

export interface ProtoGrpcType {
  llmserve: {
    v1: {
      ChatMessage: MessageTypeDefinition<_llmserve_v1_ChatMessage, _llmserve_v1_ChatMessage__Output>
      ChatMessages: MessageTypeDefinition<_llmserve_v1_ChatMessages, _llmserve_v1_ChatMessages__Output>
      FinishReason: EnumTypeDefinition
      GenerateRequest: MessageTypeDefinition<_llmserve_v1_GenerateRequest, _llmserve_v1_GenerateRequest__Output>
      GenerateResponse: MessageTypeDefinition<_llmserve_v1_GenerateResponse, _llmserve_v1_GenerateResponse__Output>
      /**
       * Text generation with the served model. The service name is part of every method
       * path on the wire, so it keeps its name (buf's SERVICE_SUFFIX is waived in buf.yaml).
       */
      Generation: SubtypeConstructor<typeof grpc.Client, _llmserve_v1_GenerationClient> & { service: _llmserve_v1_GenerationDefinition }
      GetModelInfoRequest: MessageTypeDefinition<_llmserve_v1_GetModelInfoRequest, _llmserve_v1_GetModelInfoRequest__Output>
      ModelInfo: MessageTypeDefinition<_llmserve_v1_ModelInfo, _llmserve_v1_ModelInfo__Output>
      SamplingParams: MessageTypeDefinition<_llmserve_v1_SamplingParams, _llmserve_v1_SamplingParams__Output>
      StructuredOutput: MessageTypeDefinition<_llmserve_v1_StructuredOutput, _llmserve_v1_StructuredOutput__Output>
      StructuredOutputKind: EnumTypeDefinition
      TokenIds: MessageTypeDefinition<_llmserve_v1_TokenIds, _llmserve_v1_TokenIds__Output>
      TokenLogprobs: MessageTypeDefinition<_llmserve_v1_TokenLogprobs, _llmserve_v1_TokenLogprobs__Output>
      TokenizeRequest: MessageTypeDefinition<_llmserve_v1_TokenizeRequest, _llmserve_v1_TokenizeRequest__Output>
      TokenizeResponse: MessageTypeDefinition<_llmserve_v1_TokenizeResponse, _llmserve_v1_TokenizeResponse__Output>
      Tool: MessageTypeDefinition<_llmserve_v1_Tool, _llmserve_v1_Tool__Output>
      ToolCall: MessageTypeDefinition<_llmserve_v1_ToolCall, _llmserve_v1_ToolCall__Output>
      ToolCallDelta: MessageTypeDefinition<_llmserve_v1_ToolCallDelta, _llmserve_v1_ToolCallDelta__Output>
      ToolChoice: MessageTypeDefinition<_llmserve_v1_ToolChoice, _llmserve_v1_ToolChoice__Output>
      ToolChoiceMode: EnumTypeDefinition
      Usage: MessageTypeDefinition<_llmserve_v1_Usage, _llmserve_v1_Usage__Output>
    }
  }
}

