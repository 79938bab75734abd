"""Settings of the orchestrator: one flag table, the command line and SPECDEC_ORCHESTRATOR_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from orchestrator.pool import parse_entries
from specdec.flags import Flag, FlagTable, ServedConfig, connection_flags, log_level_flag, reflection_flag, tls_flags
from specdec.grammar_limits import GrammarConfig, grammar_flags
from specdec.errors import InvalidArgument
from specdec.security import ClientTls
from specdec.wire import DraftOptions


def _ahead(value: str) -> str | int:
    """--draft-ahead: "auto" or a count of tokens."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of tokens, got {value!r}") from None

DEFAULT_PORT = 50050

FLAGS = FlagTable("SPECDEC_ORCHESTRATOR", [
    Flag("--target", required=True,
         help="target workers: HOST:PORT, comma-separated, or a name that resolves to every replica"),
    Flag("--draft", help="draft workers, the same way (omit to serve gamma 0 only); 'ngram' drafts with no model, "
         "in this process, by prompt lookup"),
    Flag("--host", default="0.0.0.0"),
    Flag("--port", int, DEFAULT_PORT),
    Flag("--http-port", int, None, "also serve the OpenAI-compatible HTTP API (/v1/completions, "
         "/v1/chat/completions, /v1/models, /tokenize, /health) on this port, same host, TLS and tokens; "
         "0: any free port (default: off)"),
    Flag("--http-max-body", int, 4 * 1024 * 1024, "the largest HTTP request body in bytes; a larger one gets 413 "
         "before it is parsed (a declared Content-Length at once, else as it arrives)", field="http_max_body_bytes"),
    Flag("--http-body-timeout", float, 30.0, "seconds an HTTP client has to send each piece of its request body; "
         "beyond it 408 and the connection is let go", field="http_body_timeout_s"),
    Flag("--http-head-timeout", float, 10.0, "seconds an HTTP client has to send a request's line and headers, "
         "from connecting or from its last answer; beyond it the connection is closed (0: no limit)",
         field="http_head_timeout_s"),
    Flag("--http-max-connections", int, 1024, "open HTTP connections beyond which a request gets 503 (0: no limit)"),
    Flag("--served-model-name", help="the model id the HTTP API lists and accepts (default: the target's name)"),
    Flag("--max-running", int, 32, "client requests decoding at once; more wait in the queue"),
    Flag("--max-queued", int, 128, "requests that may wait for a turn; beyond them RESOURCE_EXHAUSTED"),
    Flag("--request-timeout", float, 1800.0, "the deadline of a request whose client set none, in seconds; "
         "beyond it DEADLINE_EXCEEDED (0: none)", field="request_timeout_s"),
    Flag("--max-per-client", int, 0, "requests one client (its bearer token, else its IP address) may have running "
         "and waiting together; beyond them RESOURCE_EXHAUSTED (0: no limit)"),
    Flag("--gamma-policy", default="goodput", choices=["goodput", "fixed"],
         help="goodput: each step drafts the gamma (up to each request's) that maximizes measured goodput, "
              "fewer as the target's batch grows (all drafting requests share the draft and target passes); "
              "fixed: always the request's gamma"),
    Flag("--sampling", default="coupled", choices=["coupled", "rejection"],
         help="how a sampled request that names no sampling_mode draws its tokens: coupled (random noise fixed by "
              "the request's seed and each position; the server draws a seed when the request has none and reports "
              "it; rounds carry token ids only, and the same seed gives the same output whatever the gamma, load, "
              "draft or failover) or rejection (rejection sampling: slightly more drafts kept, but every round "
              "carries both models' probabilities, up to megabytes, and the output depends on every round's gamma)"),
    Flag("--draft-p-min", float, 0.0, "a draft stops proposing after a token it gave less than this probability "
         "(0: never stops before gamma)"),
    Flag("--draft-min", int, 1, "drafts a round makes before --draft-p-min may stop it", field="draft_min"),
    Flag("--draft-lookup", int, 4, "the longest n-gram a model draft looks up in the sequence to check the tokens "
         "that followed it in one pass (0: off)"),
    Flag("--suffix-cache-tokens", int, 65536, "tokens of ended requests' prompts and outputs kept per orchestrator "
         "for suffix drafts (drafts with no draft pass, from what followed the same tokens before: "
         "orchestrator/proposers/suffix.py), searched within the requesting client's auth token only; a request's own tokens "
         "are searched either way (0: only those)"),
    Flag("--suffix-drafts", default="on", choices=["on", "off"], to_config=lambda v: v == "on",
         help="suffix drafts at all (off: no draft without a draft pass, neither from the cache nor from a "
              "request's own tokens; rounds draft with the draft worker only)"),
    Flag("--draft-ahead", _ahead, "auto", to_config=lambda v: None if v == "auto" else v,
         help="tokens a model draft keeps drafting past each round's drafts while the target verifies; the next "
              "round takes them when the round kept every draft. auto: a round's drafts and one more where the "
              "draft has hardware of its own (the workers' Describe says so: specdec/hardware.py), none where "
              "it shares the target's (0: off)"),
    Flag("--worker-timeout", float, 120.0, "the longest any call to a worker may take; each call's own deadline is "
         "20x what its rows should cost at the worker's measured pace, at least 10 s, until measured this",
         field="worker_timeout_s"),
    Flag("--worker-keepalive", float, 2.0, "seconds between pings on each worker connection; a worker that does not "
         "answer one within twice this (a cut link, a frozen host) is cut off and its requests move to another "
         "worker, as are those of a worker that leaves two polls in a row (--poll-interval) unanswered for 2 s (0: off)", field="worker_keepalive_s"),
    Flag("--draft-timeout", float, 10.0,
         "deadline of one round's Propose; a slower draft is replaced (or dropped) for the request",
         field="draft_timeout_s"),
    Flag("--startup-timeout", float, 3600.0, "seconds to wait for workers to load their models",
         field="startup_timeout_s"),
    Flag("--torch-threads", int, 1, "threads for the sampling math; more only adds spinning threads"),
    Flag("--prefill", default="auto", choices=["auto", "parallel", "sequential"],
         help="parallel hides the draft's prefill when workers have their own hardware; sequential is faster "
              "when they share the same cores; auto: parallel for a draft and a target on different hardware "
              "(the workers' Describe says so), else sequential"),
    Flag("--drain-timeout", float, 20.0, "on SIGTERM: seconds requests in flight get to finish",
         field="drain_timeout_s"),
    Flag("--poll-interval", float, 1.0, "seconds between reads of each worker's load and health (at most 1 s "
         "for a worker that has not answered yet)", field="poll_s"),
    Flag("--resolve-interval", float, 10.0, "seconds between DNS resolutions of worker names (new replicas join)",
         field="resolve_s"),
    Flag("--max-new-tokens", int, 4096, "the most tokens one request may ask for"),
    Flag("--max-prompt-tokens", int, 0, "the longest prompt accepted, in tokens (0: what the context allows)"),
    log_level_flag(),
    reflection_flag(),
    *connection_flags(),
    *tls_flags(),
    Flag("--worker-tls-ca", help="reach the workers over TLS, verifying their certificates against this PEM CA"),
    Flag("--worker-tls-cert", help="mutual TLS with the workers: our cert"),
    Flag("--worker-tls-key", help="mutual TLS with the workers: our key"),
    *grammar_flags(),
    Flag("--auth-token-file",
         help="file of bearer tokens (one per line) a client must send as 'authorization: Bearer T'"),
    Flag("--admin-token-file",
         help="file of admin bearer tokens: AddWorkers, and the workers' addresses in ListWorkers, need one "
              "(they also pass where client tokens are asked for). Without it AddWorkers is off"),
], groups=[
    ("workers", ["--target", "--draft", "--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key",
                 "--resolve-interval"]),
    ("server", ["--host", "--port", "--log-level", "--reflection", "--keepalive", "--max-connection-age",
                "--max-connection-age-grace"]),
    ("security", ["--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file", "--admin-token-file"]),
    ("HTTP API (OpenAI-compatible)", ["--http-port", "--served-model-name", "--http-max-body", "--http-body-timeout",
                                      "--http-head-timeout", "--http-max-connections"]),
    ("limits", ["--max-running", "--max-queued", "--max-per-client", "--request-timeout", "--max-new-tokens",
                "--max-prompt-tokens"]),
    ("drafting and sampling", ["--gamma-policy", "--sampling", "--draft-p-min", "--draft-min", "--draft-lookup",
                               "--suffix-cache-tokens", "--suffix-drafts", "--draft-ahead", "--prefill", "--torch-threads"]),
    ("timeouts and failover", ["--worker-timeout", "--worker-keepalive", "--draft-timeout", "--poll-interval",
                               "--startup-timeout", "--drain-timeout"]),
    ("structured output", [f.name for f in grammar_flags()]),
])


@dataclass(frozen=True)
class OrchestratorConfig(ServedConfig, GrammarConfig):
    target: str  # target workers: HOST:PORT[,HOST:PORT...]; a name may resolve to many
    draft: str | None = None  # draft workers, the same way; None serves gamma 0 only
    host: str = FLAGS.default("host")
    port: int = 0  # 0: any free port (the command line's default is 50050)
    http_port: int | None = None  # the OpenAI-compatible HTTP API (orchestrator/http/); None: off
    served_model_name: str | None = None  # its model id (None: the target's model name)
    http_max_body_bytes: int = FLAGS.default("http_max_body_bytes")
    http_body_timeout_s: float = FLAGS.default("http_body_timeout_s")
    http_head_timeout_s: float = FLAGS.default("http_head_timeout_s")
    http_max_connections: int = FLAGS.default("http_max_connections")
    max_running: int = FLAGS.default("max_running")
    max_queued: int = FLAGS.default("max_queued")
    max_per_client: int = FLAGS.default("max_per_client")
    request_timeout_s: float = FLAGS.default("request_timeout_s")
    gamma_policy: str = FLAGS.default("gamma_policy")
    sampling: str = FLAGS.default("sampling")
    draft_p_min: float = FLAGS.default("draft_p_min")
    draft_min: int = FLAGS.default("draft_min")
    draft_lookup: int = FLAGS.default("draft_lookup")
    draft_ahead: int | None = FLAGS.default("draft_ahead")  # None: auto
    suffix_cache_tokens: int = FLAGS.default("suffix_cache_tokens")
    suffix_drafts: bool = FLAGS.default("suffix_drafts")
    worker_timeout_s: float = FLAGS.default("worker_timeout_s")
    worker_keepalive_s: float = FLAGS.default("worker_keepalive_s")
    draft_timeout_s: float = FLAGS.default("draft_timeout_s")
    startup_timeout_s: float = FLAGS.default("startup_timeout_s")
    torch_threads: int = FLAGS.default("torch_threads")
    prefill: str = FLAGS.default("prefill")  # auto: parallel for workers on different hardware
    drain_timeout_s: float = FLAGS.default("drain_timeout_s")
    poll_s: float = FLAGS.default("poll_s")
    resolve_s: float = FLAGS.default("resolve_s")
    max_new_tokens: int = FLAGS.default("max_new_tokens")
    max_prompt_tokens: int = FLAGS.default("max_prompt_tokens")
    log_level: str = FLAGS.default("log_level")
    tls_cert: str | None = None  # serve clients over TLS: PEM certificate chain ...
    tls_key: str | None = None  # ... and key
    tls_client_ca: str | None = None  # mutual TLS with clients: accept certificates this CA signed
    reflection: bool = FLAGS.default("reflection")  # gRPC server reflection
    keepalive_s: float = FLAGS.default("keepalive_s")
    max_connection_age_s: float = FLAGS.default("max_connection_age_s")
    max_connection_age_grace_s: float = FLAGS.default("max_connection_age_grace_s")
    worker_tls_ca: str | None = None  # reach workers over TLS, verifying them against this CA
    worker_tls_cert: str | None = None  # mutual TLS with workers: our certificate ...
    worker_tls_key: str | None = None  # ... and key
    auth_token_file: str | None = None  # bearer tokens clients must send, one per line
    admin_token_file: str | None = None  # bearer tokens of admins (AddWorkers, worker addresses)

    @property
    def draft_options(self) -> DraftOptions:
        """What every Propose asks (ahead: the fixed --draft-ahead; auto is the decoder's, per round)."""
        return DraftOptions(self.draft_p_min, self.draft_min, self.draft_lookup, self.draft_ahead or 0)

    @property
    def worker_tls(self) -> ClientTls:
        return ClientTls(self.worker_tls_ca, self.worker_tls_cert, self.worker_tls_key)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "OrchestratorConfig":
        values = FLAGS.parse(argv, "python -m orchestrator", "Run the orchestrator.")
        try:
            parse_entries(values["target"]), parse_entries(values["draft"])
            DraftOptions(values["draft_p_min"], values["draft_min"], values["draft_lookup"],
                         values["draft_ahead"] or 0).validate()
            if values["suffix_cache_tokens"] < 0:
                raise ValueError(f"--suffix-cache-tokens must be at least 0, got {values['suffix_cache_tokens']}")
        except (ValueError, InvalidArgument) as exc:
            argparse.ArgumentParser(prog="python -m orchestrator").error(str(exc))
        return cls(**values)
