"""Settings of a worker (draft or target): one flag table, the command line and the environment.

Every flag has an environment variable (SPECDEC_<ROLE>_<FLAG>, e.g. SPECDEC_TARGET_MODEL), so a
container can be configured without a command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.flags import Flag, FlagTable, ServedConfig, connection_flags, log_level_flag, reflection_flag, tls_flags
from specdec.grammar_limits import GrammarConfig, grammar_flags

DEFAULT_PORTS = {"target": 50051, "draft": 50052}  # each role's --port unless given

FLAGS = FlagTable("SPECDEC_{role}", [
    Flag("--model", required=True,
         help="local transformers directory, a .gguf file, a default-pair short name or a hub id"),
    Flag("--host", default="0.0.0.0"),
    Flag("--port", int, None, "port to serve on (default: the role's, target 50051, draft 50052; 0: any free one)"),
    Flag("--device", default="cpu", help="cpu, cuda, cuda:1, ..."),
    Flag("--dtype", default="auto", help="auto, float32, float16, bfloat16, float64"),
    Flag("--device-map", help="accelerate device map, e.g. 'auto' to spread the model over several GPUs"),
    Flag("--quantize", default="auto", field="quantization",
         choices=["auto", "none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows"],
         help="Linear layers on CPU: auto = int4-rows for a target where the native kernel builds (else "
              "int8-rows), q4k-rows for a draft where it builds (else int8); int4-rows = the source GGUF's own "
              "Q4_K/Q6_K blocks where it has them, int8-rows elsewhere (a model without a GGUF: int8-rows "
              "throughout); q4k-rows = the GGUF's blocks where it has them, every other Linear requantized to "
              "Q4_K at load (a second rounding: for drafts); "
              "int8-rows = int8 weights and per-row activations (rows independent; the native kernel, else "
              "fbgemm); fp16 = fp16 weights (rows independent with AVX-512 "
              "only); int8 = one activation scale per pass; none = plain"),
    Flag("--target-model", roles=["draft"],
         help="the target an EAGLE-3 feature head (--model HEAD_DIR) drafts for: its tokenizer, its layer count "
              "and width, and its input embedding where the head ships none"),
    Flag("--draft-vocab", int, 0, "propose only from the first N token ids (smaller output head; 0 = all)",
         roles=["draft"]),
    Flag("--max-sessions", int, 64),
    Flag("--max-cached-tokens", int, 131072,
         "tokens all sessions may hold together (the target's: ~7.5 GB in fp32); beyond it RESOURCE_EXHAUSTED"),
    Flag("--prefix-cache-tokens", int, 8192,
         "tokens of ended sessions' KV caches kept to start new sessions whose prompts begin with them (a "
         "system prompt, an agent's last turn) from a copy instead of a prefill; per tenant; 0: off"),
    Flag("--session-ttl", float, 600.0, "seconds an idle session is kept (frees what a vanished orchestrator left)",
         field="session_ttl_s"),
    Flag("--drain-timeout", float, 20.0, "on SIGTERM: seconds open sessions get to finish before the worker exits",
         field="drain_timeout_s"),
    Flag("--max-workers", int, 64, "gRPC handler threads: calls mostly wait for the model thread"),
    Flag("--max-batch-tokens", int, 512,
         "most tokens (all sessions together) in one forward pass; a longer prefill is cut into chunks"),
    Flag("--max-prefill-tokens-while-decoding", int, None,
         "most prompt tokens in one pass while other sessions are decoding, so that their next step waits for "
         "at most a chunk this long (default: 128 on CPU, where a pass's time grows with its rows; on a GPU "
         "--max-batch-tokens, where a prefill pass costs about the same at any size up to it)"),
    Flag("--cuda-graphs", default="on", choices=["on", "off"],
         help="on CUDA: decoding passes replay CUDA graphs captured at start-up over a KV cache of pages "
              "(off: the same passes eager, as vLLM's --enforce-eager)"),
    Flag("--pass-lock", default="auto",
         help="what to lock around each forward pass, so that the passes of workers sharing cores take turns "
              "instead of oversubscribing them: auto (on CPU: a file per CPU this worker may run on, in the temp "
              "folder, shared by every worker of this user on this host; on a GPU: nothing), off, or one file"),
    *grammar_flags(),
    log_level_flag(),
    reflection_flag(),
    *connection_flags(),
    *tls_flags(),
], groups=[
    ("model and device", ["--model", "--device", "--dtype", "--device-map", "--quantize", "--cuda-graphs",
                          "--target-model", "--draft-vocab"]),
    ("server", ["--host", "--port", "--max-workers", "--drain-timeout", "--log-level", "--reflection", "--keepalive",
                "--max-connection-age", "--max-connection-age-grace"]),
    ("security", ["--tls-cert", "--tls-key", "--tls-client-ca"]),
    ("sessions and memory", ["--max-sessions", "--max-cached-tokens", "--prefix-cache-tokens", "--session-ttl"]),
    ("batching", ["--max-batch-tokens", "--max-prefill-tokens-while-decoding", "--pass-lock"]),
    ("structured output", [f.name for f in grammar_flags()]),
])


@dataclass(frozen=True)
class WorkerConfig(ServedConfig, GrammarConfig):
    role: str  # "draft" or "target"
    model: str
    host: str = FLAGS.default("host")
    port: int = 0  # 0: any free port (the command line's default is the role's port)
    device: str = FLAGS.default("device")
    dtype: str = FLAGS.default("dtype")
    device_map: str | None = FLAGS.default("device_map")
    quantization: str = FLAGS.default("quantization")  # auto on CPU: fp16 Linear weights (a draft: int8)
    target_model: str | None = None  # draft only: the target a feature head drafts for
    draft_vocab: int = FLAGS.default("draft_vocab")  # draft only: score just the first N token ids (0: all)
    max_sessions: int = FLAGS.default("max_sessions")
    max_cached_tokens: int = FLAGS.default("max_cached_tokens")
    prefix_cache_tokens: int = FLAGS.default("prefix_cache_tokens")  # ended sessions' caches kept for reuse
    session_ttl_s: float = FLAGS.default("session_ttl_s")  # an idle session is freed after this
    drain_timeout_s: float = FLAGS.default("drain_timeout_s")
    max_workers: int = FLAGS.default("max_workers")
    max_batch_tokens: int = FLAGS.default("max_batch_tokens")
    max_prefill_tokens_while_decoding: int | None = FLAGS.default("max_prefill_tokens_while_decoding")  # None: by device
    cuda_graphs: str = FLAGS.default("cuda_graphs")  # on CUDA: replay captured decoding passes
    pass_lock: str = FLAGS.default("pass_lock")  # auto, off, or a file: workers sharing cores take turns
    log_level: str = FLAGS.default("log_level")
    tls_cert: str | None = None  # serve TLS with this PEM certificate chain ...
    tls_key: str | None = None  # ... and key
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)
    reflection: bool = FLAGS.default("reflection")  # gRPC server reflection
    keepalive_s: float = FLAGS.default("keepalive_s")
    max_connection_age_s: float = FLAGS.default("max_connection_age_s")
    max_connection_age_grace_s: float = FLAGS.default("max_connection_age_grace_s")

    @classmethod
    def from_args(cls, role: str, argv: list[str] | None = None, default_port: int = 0) -> "WorkerConfig":
        values = FLAGS.parse(argv, f"python -m {role}_service", f"Run the {role} worker.", role)
        if values["port"] is None:
            values["port"] = default_port
        return cls(role, **values)
