'use strict';
// Loads llmserve's public API (llmserve/v1/generation.proto) for @grpc/grpc-js with
// the options it is meant to be read with. Without keepCase, proto-loader renames
// fields to camelCase, and a request's `max_tokens` is silently dropped.
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_FILE = path.join(__dirname, 'llmserve', 'v1', 'generation.proto');

// The same options produced the TypeScript types in types/ (npm run types).
const LOADER_OPTIONS = Object.freeze({
  keepCase: true, // field names as in the .proto: max_tokens, finish_reason
  longs: String, // int64 (seed) as a decimal string: no precision lost above 2^53
  enums: String, // finish_reason as 'FINISH_REASON_STOP', not 1
  defaults: true, // unset scalars read as their zero value
  oneofs: true, // GenerateRequest.input names the form of the prompt
  includeDirs: [__dirname],
});

/** The llmserve.v1 package: message types and the Generation service constructor. */
function loadApi() {
  const definition = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition).llmserve.v1;
}

/**
 * A Generation client. `credentials` defaults to plaintext; pass
 * grpc.credentials.createSsl(ca) for a router with TLS, and add
 * `authorization: Bearer <key>` metadata per call when it requires API keys.
 */
function createGenerationClient(address, credentials = grpc.credentials.createInsecure(), options = {}) {
  const { Generation } = loadApi();
  return new Generation(address, credentials, options);
}

module.exports = { PROTO_FILE, LOADER_OPTIONS, loadApi, createGenerationClient };
