"""The request lifecycle of speculative decoding: one request, many rounds, any pair of workers.

A request is encoded and validated, placed and prefilled, then driven round by round until EOS,
a stop string or max_new_tokens, then closed. Where a request goes next, one round at a time
(draft, verify, accept, commit, emit; rollback without an extra call; gamma 0 as the baseline),
is orchestrator/rounds.py; every request runs them in its target's step loop, together with the
other requests there (orchestrator/steps.py).

Each request takes one target and one draft from their pools (orchestrator/pool.py: least
loaded) and keeps them to the end, since its KV caches live there (orchestrator/placement.py
moves them when a worker fails). With no draft serving, the request runs as gamma 0, which
gives the same tokens greedily and the same distribution sampled.
Spans: a request span (GenAI attributes) holding prefill, one `round` per round (draft, verify,
rejection_sampling, rollback) and close; the gRPC client spans under them carry the trace to
the workers. Metrics get the same numbers as the returned stats (orchestrator/metrics.py).
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import grpc
import torch
from opentelemetry import trace

from orchestrator.detokenizer import TextAssembler
from orchestrator.gamma import GammaPolicy
from orchestrator.metrics import DecodingMetrics
from orchestrator.placement import Placement
from orchestrator.pool import WorkerPool, pair_pools
from orchestrator.rounds import RequestState
from orchestrator.steps import StepLoops
from orchestrator.proposers.suffix import SuffixIndex
from orchestrator.validation import MAX_N, RequestChecks
from orchestrator import tool_calls
from orchestrator.workers import DraftWorker, TargetWorker
from specdec import telemetry as t
from specdec.errors import Cancelled, ServiceError
from specdec.protocol import GenerationChunk, GenerationRequest, GenerationResult, GenerationStats, RequestLimits
from specdec.telemetry import Telemetry
from specdec.wire import DraftOptions

log = logging.getLogger(__name__)


def load_tokenizer_from(target: TargetWorker):
    """The orchestrator's tokenizer is the target's, fetched as files: no model files needed here."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="specdec-tokenizer-") as tmp:
        for name, data in target.tokenizer_files().items():
            (Path(tmp) / Path(name).name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


@dataclass
class CollectedChoice:
    """One choice's whole answer, gathered from its chunks: the last chunk holds why it finished,
    its stats and tool calls."""

    text: str
    token_ids: list[int]
    logprobs: list
    last: GenerationChunk


def collect_choices(stream: Iterator[GenerationChunk],
                    between: Callable[[GenerationChunk], None] | None = None) -> list[CollectedChoice]:
    """Every choice of a request's stream, in index order (one unless n > 1). between(chunk) runs
    after each chunk (a caller's checks: its client still there, its deadline); what it raises
    closes the stream and goes up."""
    parts: dict[int, tuple[list, list, list, list]] = {}  # index -> text, ids, logprobs, [last chunk]
    try:
        for chunk in stream:
            text, ids, logprobs, last = parts.setdefault(chunk.index, ([], [], [], []))
            text.append(chunk.text_delta)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs or ())
            if chunk.finish_reason is not None:
                last.append(chunk)
            if between is not None:
                between(chunk)
    finally:
        stream.close()
    return [CollectedChoice("".join(text), ids, logprobs, last[0])
            for _, (text, ids, logprobs, last) in sorted(parts.items())]


class SpeculativeDecoder:
    """Runs requests against pools of targets and drafts (or one of each, in-process)."""

    def __init__(self, target: TargetWorker | WorkerPool, draft: DraftWorker | WorkerPool | None = None,
                 tokenizer=None, *, prefill: str = "auto", draft_ahead: int | None = None,
                 telemetry: Telemetry | None = None, drafts_left_out: bool = False,
                 limits: RequestLimits = RequestLimits(), gamma_policy: GammaPolicy | None = None,
                 draft_options: DraftOptions = DraftOptions(), sampling: str = "coupled",
                 grammar_limits=None, suffix_cache_tokens: int | None = 0):
        self.limits = limits
        # how a sampled request that names no sampling_mode draws its tokens (--sampling)
        self.sampling = sampling
        self.targets = target if isinstance(target, WorkerPool) else WorkerPool.fixed("target", [target])
        self.drafts = draft if isinstance(draft, WorkerPool) or draft is None else WorkerPool.fixed("draft", [draft])
        if self.targets.accept is None:  # fixed pools: pair them and describe their members now
            pair_pools(self.targets, self.drafts)
            for pool in (self.targets, self.drafts):
                if pool is not None:
                    pool.poll()
        first_target = self.targets.wait_for_member(0)
        self.target_info = self.targets.reference
        self.draft_info = self.drafts.wait_for_member(0).info if self.drafts is not None else None
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer_from(first_target.worker)
        self.eos = frozenset(self.target_info.eos_token_ids)
        self.max_context = min(i.max_context for i in (self.target_info, self.draft_info) if i is not None)
        # what a request may ask (orchestrator/validation.py), checked before any worker holds a session
        # drafts_left_out: the configured drafts all failed to load (orchestrator/server.py): a request
        # may still ask for drafts, and runs as with every draft down
        self.checks = RequestChecks(self.tokenizer, vocab_size=self.target_info.vocab_size, max_context=self.max_context,
                                    limits=limits, eos=self.eos, has_draft=self.drafts is not None or drafts_left_out,
                                    model_name=self.target_info.model_name, grammar_compiler=self.grammar_compiler)
        # prefilling both at once hides the draft's prefill when the workers have their own
        # hardware; on shared cores (in-process, one host) it only makes them contend. auto: each
        # request's placement decides from its workers' Describe (Placement.apart)
        self.prefill = prefill
        self._prefill_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="prefill") \
            if prefill != "sequential" else None
        self.telemetry = telemetry or Telemetry.off()
        self.tracer = self.telemetry.tracer
        self.metrics = DecodingMetrics(self.telemetry.meter)
        # in-process callers get the request's gamma unless they pass a policy; the server passes
        # --gamma-policy's (goodput by default)
        self.gamma_policy = gamma_policy or GammaPolicy(adaptive=False)
        self.draft_options = draft_options.validate()  # sent with every Propose (--draft-p-min, --draft-lookup)
        # tokens drafted ahead (DraftOptions.ahead): a fixed count, or None: a round's drafts and
        # one more where the request's draft has hardware of its own (rounds.RequestState.ahead)
        self.draft_ahead = draft_ahead if draft_ahead is not None else (draft_options.ahead or None)
        # one step loop per target runs the rounds of all its requests together (orchestrator/steps.py)
        # (suffix drafts, when the gamma policy is goodput: a request's own tokens and, up to
        # --suffix-cache-tokens, ended requests'; None: no suffix drafts, --suffix-drafts off)
        self.steps = StepLoops(self.gamma_policy, self.tracer, self.metrics,
                               SuffixIndex(suffix_cache_tokens) if suffix_cache_tokens is not None else None)
        self.grammar_limits = grammar_limits  # specdec.grammar.GrammarLimits (the --grammar-* flags); None: defaults
        self._grammars = None
        self._grammars_lock = threading.Lock()
        threading.Thread(target=self.grammar_compiler, name="grammar-compiler", daemon=True).start()

    def close(self) -> None:
        """Stops the step loops (requests still in them fail UNAVAILABLE); logs what the step
        policy measured (orchestrator/gamma.py)."""
        self.steps.close()
        for row in self.gamma_policy.snapshot() if self.gamma_policy.adaptive else ():
            log.info("step policy on %s at %s requests, %s: %s running; %.2f tok/s with, %.2f without; %d steps, "
                     "%.1f%% exploring, %.2f s regret, %d switches", row["target"], row["level"], row["kind"],
                     row["running"], row["draft_tok_s"], row["plain_tok_s"], row["steps"], 100 * row["explore_share"],
                     row["regret_s"], row["switches"])

    # ---- request handling ----------------------------------------------------------------

    def grammar_compiler(self):
        """A GrammarCompiler for the target's tokenizer (specdec/grammar.py): the orchestrator
        compiles a request's grammar once to refuse a bad one with the engine's reason; the
        workers compile their own (each caches by spec). Made at start-up, in the background."""
        with self._grammars_lock:
            if self._grammars is None:
                from specdec.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.target_info.vocab_size, sorted(self.eos),
                                                 self.grammar_limits)
            return self._grammars

    def sampling_mode(self, request: GenerationRequest) -> str:
        """"greedy", or how a sampled request draws: coupled (Gumbel-max keyed by its seed, drawn
        by the server when the request has none: the same tokens for any gamma, batch or draft,
        token ids alone on the wire) or rejection (Leviathan et al.: the best acceptance; the
        draws depend on every round, and each round carries distributions). Unasked: --sampling's
        (coupled), with a seed or without."""
        if request.sampling.greedy:
            return "greedy"
        if request.sampling_mode is not None:
            return request.sampling_mode
        return self.sampling

    def generate(self, request: GenerationRequest,
                 between: Callable[[GenerationChunk], None] | None = None) -> GenerationResult:
        """The whole answer; with n > 1, choice 0's, with every choice in `choices`. between(chunk),
        called after each chunk, may raise to stop the request (its sessions close)."""
        results = [GenerationResult(c.text, c.token_ids, c.last.finish_reason, c.last.stats.to_dict(),
                                    c.logprobs if request.logprobs else None, c.last.tool_calls)
                   for c in collect_choices(self.generate_stream(request), between)]
        if len(results) > 1:
            results[0].choices = results
        return results[0]

    def generate_stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """The request's chunks as its rounds make them; with n > 1, the chunks of its n choices
        (GenerationChunk.index) as each makes them, every choice with its own sessions forked from
        one prefill (Placement.fork) and its own seed (choice_seed)."""
        t_start = time.perf_counter()
        operation = "chat" if request.messages is not None else "text_completion"
        span = self.tracer.start_span(f"{operation} {self.target_info.model_name}", attributes={
            t.GEN_AI_OPERATION: operation, t.GEN_AI_REQUEST_MODEL: self.target_info.model_name,
            t.GEN_AI_TEMPERATURE: request.temperature,
            t.GEN_AI_TOP_P: request.top_p, t.GEN_AI_TOP_K: request.top_k, t.GAMMA: request.gamma,
        })
        ctx = trace.set_span_in_context(span)
        drafts = self.drafts if request.gamma > 0 else None
        n = request.n if 1 <= request.n <= MAX_N else 1  # checks.params refuses others, before any placement
        placements = [Placement(uuid.uuid4().hex, self.targets, drafts, self.tracer, self._prefill_pool,
                                request.cache_scope, prefill=self.prefill) for _ in range(n)]
        streams: list[Iterator[GenerationChunk]] = []
        try:
            prompt = self.checks.prompt(request)
            if request.max_new_tokens is None:  # as many as fit the context and this server's limit
                request = replace(request, max_new_tokens=max(1, min(self.limits.max_new_tokens,
                                                                     self.max_context - len(prompt))))
            params = self.checks.params(request, len(prompt))
            span.set_attribute(t.GEN_AI_MAX_TOKENS, request.max_new_tokens)
            seed = request.seed if request.seed is not None else draw_seed()
            mode = self.sampling_mode(request)
            # an attribute is a signed 64-bit integer: a seed past 2**63 - 1 shows as the same 64 bits, signed
            span.set_attributes({t.SESSION_ID: placements[0].session_id,
                                 t.GEN_AI_SEED: seed if seed < 2**63 else seed - 2**64,
                                 t.GEN_AI_INPUT_TOKENS: len(prompt)})
            with self.tracer.start_as_current_span("prefill", context=ctx), self.steps.prefill():
                t0 = time.perf_counter()
                placements[0].open(prompt)
                for placement in placements[1:]:  # the other choices copy the prompt's caches
                    placement.fork(placements[0], prompt)
                prefill_s = time.perf_counter() - t0
            self.metrics.record_prefill(prefill_s)
            all_stats = []
            for i, placement in enumerate(placements):
                seed_i = choice_seed(seed, i)
                stats = GenerationStats(prompt_tokens=len(prompt), gamma=request.gamma, sampling=mode, seed=seed_i,
                                        prefill_s=prefill_s, cached_tokens=placements[0].cached_tokens)
                params_i = replace(params, coupling_seed=seed_i) if mode == "coupled" else params
                all_stats.append(stats)
                streams.append(self._rounds(placement, prompt, request, params_i,
                                            torch.Generator().manual_seed(seed_i), stats, ctx))
            first_token_s = None
            calling = bool(request.tools) and request.tool_choice != "none"
            names = {tool["function"]["name"] for tool in request.tools} if calling else None
            text = [[] for _ in range(n)]  # with tools: each choice's whole text, parsed for calls at the end
            for chunk in streams[0] if n == 1 else _merged(streams):
                stats = all_stats[chunk.index]
                if calling:
                    text[chunk.index].append(chunk.text_delta)
                    if chunk.finish_reason is not None:
                        calls = tool_calls.parse("".join(text[chunk.index]), names)[1]
                        if calls:
                            chunk.tool_calls = [c.as_openai() for c in calls]
                            chunk.finish_reason = "tool_calls"
                if first_token_s is None and chunk.token_ids:
                    first_token_s = time.perf_counter() - t_start
                    self.metrics.record_first_token(first_token_s)
                if chunk.stats is not None:
                    span.set_attributes({
                        t.GEN_AI_OUTPUT_TOKENS: sum(s.generated_tokens for s in all_stats),
                        t.GEN_AI_FINISH_REASONS: [chunk.finish_reason],
                        t.GEN_AI_RESPONSE_MODEL: self.target_info.model_name, t.ROUNDS: stats.rounds,
                        t.DRAFTED: stats.drafted_tokens, t.ACCEPTED: stats.accepted_tokens,
                        t.ACCEPTANCE_RATE: stats.acceptance_rate, t.WIRE_BYTES: stats.wire_bytes,
                    })
                yield chunk
                if chunk.stats is not None:
                    self.metrics.record_finished(stats, first_token_s, time.perf_counter() - t_start)
        except ServiceError as exc:
            self._failed(span, exc)
            raise
        except GeneratorExit:  # the client went away
            self._failed(span, Cancelled("the client cancelled the request"))
            raise
        except Exception as exc:
            self._failed(span, ServiceError(f"{type(exc).__name__}: {exc}", grpc.StatusCode.INTERNAL))
            raise
        finally:
            for stream in streams:  # leave the step loop (waiting for the step) before the sessions close
                stream.close()
            placement = placements[0]
            span.set_attributes({
                **({t.TARGET_ADDRESS: placement.target.address} if placement.target else {}),
                **({t.DRAFT_ADDRESS: placement.draft.address} if placement.draft else {}),
                **({t.FALLBACK: placement.draft_dropped} if placement.draft_dropped else {}),
                t.TARGET_MODEL: self.target_info.model_name,
                **({t.DRAFT_MODEL: self.draft_info.model_name} if self.draft_info and request.gamma > 0 else {}),
            })
            with self.tracer.start_as_current_span("close", context=ctx):
                for placement in placements:
                    placement.close()
            span.end()

    def _failed(self, span, exc: ServiceError) -> None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{exc.code.name}: {exc.message}"))
        span.set_attribute(t.STATUS, exc.code.value[0])
        self.metrics.record_failed(exc.code.value[0])

    def _rounds(self, placement: Placement, prompt, request, params, generator, stats,
                ctx) -> Iterator[GenerationChunk]:
        """Drives the request round by round in its target's step loop, with the other requests
        there (orchestrator/steps.py, which records each round's metrics)."""
        state = RequestState(placement, params, generator, self.tracer,
                             frozenset() if request.ignore_eos else self.eos, request.gamma,
                             request.max_new_tokens, list(prompt), stats, TextAssembler(self.tokenizer, request.stop),
                             started=time.perf_counter() - stats.prefill_s, policy=self.gamma_policy,
                             draft_options=self.draft_options, draft_ahead=self.draft_ahead,
                             top_logprobs=request.top_logprobs if request.logprobs else None,
                             stop_token_ids=frozenset(request.stop_token_ids))
        yield from self.steps.join(state, ctx)  # leaving it (done, failed, cancelled) waits for the step
        if state.finish is not None and self.steps.suffix is not None:  # ended whole: later requests may draft
            # from it (here, not in the step loop)
            self.steps.suffix.add(placement.scope, state.tokens)


def draw_seed() -> int:
    """The seed of a sampled request that brought none: 63 random bits (it goes back in
    stats.seed, and re-sent with the request it reproduces the answer)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed, as an unsigned 64-bit integer: the request's seed for choice 0 (so n
    = 1 is unchanged), then steps of the golden ratio (a Weyl sequence, as splitmix64 steps)."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


def _merged(streams: list[Iterator[GenerationChunk]]) -> Iterator[GenerationChunk]:
    """The chunks of several choices' streams as they come, each tagged with its choice's index.
    Each stream runs on a thread of its own (a choice in the step loop waits for its step); a
    failure of one ends all; leaving early (the client went away) ends each within one round."""
    out: queue.Queue = queue.Queue()
    stop = threading.Event()

    def run(index: int, stream: Iterator[GenerationChunk]) -> None:
        try:
            for chunk in stream:
                chunk.index = index
                out.put(chunk)
                if stop.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            out.put(exc)
        finally:
            stream.close()
            out.put(None)

    threads = [threading.Thread(target=t.run_in_context, args=(t.current_context(), run, i, s), daemon=True,
                                name=f"choice-{i}") for i, s in enumerate(streams)]
    for thread in threads:
        thread.start()
    running = len(threads)
    try:
        while running:
            item = out.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        stop.set()
        for thread in threads:
            thread.join()
