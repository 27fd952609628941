// The same client in TypeScript: `npm run typecheck` proves @llmserve/api's types
// describe what the loader returns (field names as in the .proto, enums as strings).
import * as grpc from '@grpc/grpc-js';
import { createGenerationClient, GenerateRequest, GenerateResponse } from '@llmserve/api';

const client = createGenerationClient(process.env.LLMSERVE_TARGET || 'localhost:50051', grpc.credentials.createInsecure());
const request: GenerateRequest = {
  text: 'The capital of France is',
  params: { max_tokens: 8, temperature: 0, seed: '7' },
};
const call = client.Generate(request);
call.on('data', (piece: GenerateResponse) => {
  const reason: string = piece.finish_reason; // e.g. 'FINISH_REASON_STOP'
  process.stdout.write(piece.text + (reason === 'FINISH_REASON_UNSPECIFIED' ? '' : `\n[${reason}]\n`));
});
call.on('end', () => client.close());
