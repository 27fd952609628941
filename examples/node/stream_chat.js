#!/usr/bin/env node
'use strict';
// Streams one chat completion from an llmserve router and prints the text as it comes.
//
//   npm install                       (once, in this folder)
//   node stream_chat.js "Write a haiku about gRPC" [address]
//
// The address defaults to LLMSERVE_TARGET, else localhost:50051. The router's TLS and
// API key come from the same variables the Python client reads: LLMSERVE_TLS_CA (PEM
// file of the CA that signed the router's certificate), LLMSERVE_API_KEY, and
// LLMSERVE_INSECURE=1 for a plaintext router (`llmserve up --insecure`).
const fs = require('fs');
const grpc = require('@grpc/grpc-js');
const { createGenerationClient } = require('@llmserve/api');

function credentials() {
  if (['1', 'true', 'yes', 'on'].includes((process.env.LLMSERVE_INSECURE || '').toLowerCase())) {
    return grpc.credentials.createInsecure();
  }
  const ca = process.env.LLMSERVE_TLS_CA ? fs.readFileSync(process.env.LLMSERVE_TLS_CA) : null;
  return grpc.credentials.createSsl(ca);
}

function main() {
  const prompt = process.argv[2] || 'Write a haiku about gRPC';
  const address = process.argv[3] || process.env.LLMSERVE_TARGET || 'localhost:50051';
  const client = createGenerationClient(address, credentials());
  const metadata = new grpc.Metadata();
  if (process.env.LLMSERVE_API_KEY) metadata.set('authorization', `Bearer ${process.env.LLMSERVE_API_KEY}`);

  const call = client.Generate(
    {
      messages: { messages: [{ role: 'user', content: prompt }] },
      // snake_case, as in the .proto: the loader keeps field names (keepCase).
      params: { max_tokens: Number(process.env.MAX_TOKENS || 64), temperature: 0 },
    },
    metadata,
  );
  call.on('data', (piece) => {
    process.stdout.write(piece.text);
    if (piece.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      const usage = piece.usage || {};
      process.stdout.write(`\n[${piece.finish_reason} prompt_tokens=${usage.prompt_tokens} completion_tokens=${usage.completion_tokens}]\n`);
    }
  });
  call.on('error', (err) => {
    // One line: the status name and the server's message.
    console.error(`stream_chat: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on('end', () => client.close());
}

main();
