// An example TypeScript (Node) client of the specdec orchestrator: one unary Generate and one
// streamed GenerateStream over real gRPC (HTTP/2), with a bearer token when one is given.
//
//   npm ci && npm run build
//   node dist/main.js --server localhost:50050 --prompt "def fib(n):" --max-new-tokens 32 --temperature 0
//
// Output: JSON Lines on stdout, one object per line: for the stream, one {"event": "chunk"} line per
// chunk as it arrives; for each call, a {"event": "result"} line with the whole text, the token ids,
// the finish reason and the stats (snake_case, as in the proto). A refused call prints
// "STATUS_NAME: message" on stderr (UNAUTHENTICATED: ..., as the Python CLI does) and exits 1.
//
// The messages and the service descriptor come from proto/specdec/v1/orchestrator.proto, generated
// into src/gen by `npm run generate` (buf + protoc-gen-es); the transport is Connect's gRPC transport
// for Node, which speaks plain gRPC to the orchestrator's grpcio server.

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { create, toJson, type JsonObject } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import {
  FinishReason,
  GenerateRequestSchema,
  GenerationStatsSchema,
  Orchestrator,
  SamplingMode,
  type GenerateRequest,
  type GenerationStats,
} from "./gen/specdec/v1/orchestrator_pb.js";

const USAGE = `usage: node dist/main.js [options]

  --server HOST:PORT     the orchestrator (default $SPECDEC_SERVER or localhost:50050)
  --token TOKEN          bearer token, sent as "authorization: Bearer TOKEN" (default $SPECDEC_TOKEN)
  --tls-ca FILE          the orchestrator speaks TLS: verify it against this PEM CA ($SPECDEC_TLS_CA)
  --tls-cert FILE        mutual TLS: our PEM certificate ($SPECDEC_TLS_CERT)
  --tls-key FILE         mutual TLS: our PEM key ($SPECDEC_TLS_KEY)
  --prompt TEXT          the prompt (default "def fibonacci(n):")
  --token-ids 1,2,3      a prompt of token ids instead of text
  --call WHICH           generate, stream or both (default both)
  --max-new-tokens N     default 128 (the server's)
  --temperature T        0 = greedy; default 1 (the server's)
  --top-k K, --top-p P, --seed S, --gamma G, --stop STRING (repeatable),
  --sampling-mode coupled|rejection
  --timeout-s S          deadline of each call (default 120)
`;

function parse() {
  const { values } = parseArgs({
    options: {
      server: { type: "string", default: process.env.SPECDEC_SERVER ?? "localhost:50050" },
      token: { type: "string", default: process.env.SPECDEC_TOKEN },
      "tls-ca": { type: "string", default: process.env.SPECDEC_TLS_CA },
      "tls-cert": { type: "string", default: process.env.SPECDEC_TLS_CERT },
      "tls-key": { type: "string", default: process.env.SPECDEC_TLS_KEY },
      prompt: { type: "string", default: "def fibonacci(n):" },
      "token-ids": { type: "string" },
      call: { type: "string", default: "both" },
      "max-new-tokens": { type: "string" },
      temperature: { type: "string" },
      "top-k": { type: "string" },
      "top-p": { type: "string" },
      seed: { type: "string" },
      gamma: { type: "string" },
      stop: { type: "string", multiple: true, default: [] },
      "sampling-mode": { type: "string" },
      "timeout-s": { type: "string", default: "120" },
      help: { type: "boolean", short: "h", default: false },
    },
    strict: true,
  });
  if (values.help) {
    process.stdout.write(USAGE);
    process.exit(0);
  }
  if (!["generate", "stream", "both"].includes(values.call)) {
    throw new UsageError(`--call must be generate, stream or both, not ${values.call}`);
  }
  return values;
}

class UsageError extends Error {}

function number(name: string, value: string | undefined, integer = false): number | undefined {
  if (value === undefined) return undefined;
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n) || (integer && !Number.isInteger(n))) {
    throw new UsageError(`--${name} takes ${integer ? "an integer" : "a number"}, not ${JSON.stringify(value)}`);
  }
  return n;
}

type Args = ReturnType<typeof parse>;

/** The GenerateRequest the arguments describe; unset fields take the server's defaults. */
function requestOf(a: Args): GenerateRequest {
  const ids = a["token-ids"];
  const mode = a["sampling-mode"];
  if (mode !== undefined && mode !== "coupled" && mode !== "rejection") {
    throw new UsageError(`--sampling-mode must be coupled or rejection, not ${mode}`);
  }
  const seed = a.seed;
  if (seed !== undefined && !/^\d+$/.test(seed)) throw new UsageError(`--seed takes an unsigned integer, not ${seed}`);
  return create(GenerateRequestSchema, {
    input: ids !== undefined
      ? { case: "tokens", value: { tokenIds: ids.split(",").map((t) => number("token-ids", t, true)!) } }
      : { case: "prompt", value: a.prompt },
    maxNewTokens: number("max-new-tokens", a["max-new-tokens"], true),
    temperature: number("temperature", a.temperature),
    topK: number("top-k", a["top-k"], true),
    topP: number("top-p", a["top-p"]),
    seed: seed === undefined ? undefined : BigInt(seed),
    gamma: number("gamma", a.gamma, true),
    stop: a.stop,
    samplingMode: mode === "coupled" ? SamplingMode.COUPLED : mode === "rejection" ? SamplingMode.REJECTION
      : SamplingMode.UNSPECIFIED,
  });
}

/** Adds the bearer token to every call's metadata. */
function bearer(token: string): Interceptor {
  return (next) => async (req) => {
    req.header.set("authorization", `Bearer ${token}`);
    return next(req);
  };
}

function finishReason(r: FinishReason): string {
  return (FinishReason[r] ?? String(r)).toLowerCase(); // "length", "eos", "stop_string"
}

function stats(s: GenerationStats | undefined): JsonObject | null {
  return s ? (toJson(GenerationStatsSchema, s, { useProtoFieldName: true, alwaysEmitImplicit: true }) as JsonObject)
    : null;
}

function emit(line: object): void {
  process.stdout.write(JSON.stringify(line) + "\n");
}

/** "Unauthenticated" -> "UNAUTHENTICATED", "InvalidArgument" -> "INVALID_ARGUMENT": gRPC's names. */
function statusName(code: Code): string {
  return (Code[code] ?? String(code)).replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}

async function main(): Promise<void> {
  const a = parse();
  const request = requestOf(a);
  const timeoutMs = number("timeout-s", a["timeout-s"])! * 1000;
  const tls = a["tls-ca"] !== undefined || a["tls-cert"] !== undefined || a["tls-key"] !== undefined;
  const read = (path: string | undefined) => (path === undefined ? undefined : readFileSync(path));
  const transport = createGrpcTransport({
    baseUrl: `${tls ? "https" : "http"}://${a.server}`,
    // TLS: the CA to verify the orchestrator (Node's own CAs when not given), and for mutual TLS our
    // certificate and key
    nodeOptions: tls ? { ca: read(a["tls-ca"]), cert: read(a["tls-cert"]), key: read(a["tls-key"]) } : undefined,
    interceptors: a.token ? [bearer(a.token)] : [],
    defaultTimeoutMs: timeoutMs,
  });
  const client = createClient(Orchestrator, transport);

  if (a.call !== "stream") {
    const r = await client.generate(request);
    emit({ call: "generate", event: "result", text: r.text, token_ids: r.tokenIds,
           finish_reason: finishReason(r.finishReason), stats: stats(r.stats) });
  }
  if (a.call !== "generate") {
    let text = "";
    const tokenIds: number[] = [];
    let chunks = 0;
    let last: { finishReason: FinishReason; stats?: GenerationStats } | undefined;
    for await (const chunk of client.generateStream(request)) {
      emit({ call: "stream", event: "chunk", index: chunks, text_delta: chunk.textDelta,
             token_ids: chunk.tokenIds });
      text += chunk.textDelta;
      tokenIds.push(...chunk.tokenIds);
      chunks += 1;
      last = chunk;
    }
    emit({ call: "stream", event: "result", text, token_ids: tokenIds, chunks,
           finish_reason: finishReason(last?.finishReason ?? FinishReason.UNSPECIFIED), stats: stats(last?.stats) });
  }
}

main().catch((err: unknown) => {
  if (err instanceof ConnectError) {
    process.stderr.write(`${statusName(err.code)}: ${err.rawMessage}\n`);
    process.exitCode = 1;
  } else if (err instanceof UsageError || (err instanceof TypeError && "code" in err
             && String(err.code).startsWith("ERR_PARSE_ARGS"))) {
    process.stderr.write(`${err.message}\n\n${USAGE}`);
    process.exitCode = 2;
  } else {
    process.stderr.write(`${err instanceof Error ? err.stack ?? err.message : String(err)}\n`);
    process.exitCode = 1;
  }
});
