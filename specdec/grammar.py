"""Structured output: a request's grammar, compiled once per tokenizer, followed token by token per session.

Owns: `GrammarSpec` (what a request asks for: a JSON schema, any JSON object, a regex, a choice list or a
Lark/GBNF grammar), `GrammarCompiler` (spec -> `CompiledGrammar` for one tokenizer, behind a bounded LRU
cache and the engine's resource limits) and `Matcher` (one session's place in its grammar: the mask of
allowed tokens, consume, absolute truncate, forced tokens, and the masks a verify pass needs after each
drafted token). It does not own where masks are applied (draft steps, verify rows, the tests' reference
loop all call `apply`), the wire format, or sessions: a worker keeps one Matcher beside each session and
truncates both to the same length.

The engine is llguidance (over xgrammar for its compile times and resource limits:
docs/benchmarks/grammar-engines/). A mask is the engine's packed form, one int32 word per 32 token
ids (bit i of word w is token 32*w + i), over `vocab_size` ids:
embedding rows beyond the tokenizer and the tokenizer's special tokens other than EOS are never allowed.
When the grammar is complete only the EOS ids are allowed; consuming one there is recorded but does not
advance the grammar. Apply a mask before temperature, top-k and top-p, so that they act on allowed tokens only.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch

from specdec.errors import FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted
from specdec.grammar_limits import GrammarLimits
from specdec.protocol import GRAMMAR_KINDS as KINDS, GrammarSpec  # noqa: F401 - the spec is a wire record

log = logging.getLogger(__name__)

_NORMAL_STOPS = ("NoExtension", "EndOfSentence", "NoExtensionBias")  # others are the engine giving up
_NEG_INF_BITS = -8388608  # 0xFF800000 as int32: the bit pattern of float32 -inf


class GrammarViolation(FailedPrecondition):
    """A token the grammar forbids was passed to `Matcher.consume` (the matcher is left unchanged)."""


class UnsatisfiableGrammar(InvalidArgument):
    """The grammar allows no token of the model's vocabulary where the output has to go on (e.g. a
    layout that needs a character no token spells): the request cannot be answered as asked."""

    param = "structured_output"


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int
    max_size: int


class CompiledGrammar:
    """A spec compiled for one tokenizer; `matcher()` starts a session at the grammar's beginning."""

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, compiler: "GrammarCompiler",
                 compile_ms: float):
        self.spec = spec
        self.compile_ms = compile_ms
        self._template = template  # never advanced: sessions get copies (microseconds; lexer states shared)
        self._compiler = compiler

    def matcher(self) -> "Matcher":
        return Matcher(self._template.deep_copy(), self._compiler.vocab_size, self._compiler.eos_token_ids)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer. Thread-safe; wrapping the tokenizer costs ~1 s for a
    150k vocabulary (once, here), a compile ~0.3-6 ms (docs/benchmarks/grammar-engines/)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], limits: GrammarLimits | None = None):
        """tokenizer: a transformers fast tokenizer; vocab_size: the model's logits width (>= the tokenizer's
        length: ids past the tokenizer are never allowed); eos_token_ids: the ids that end generation."""
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {len(tokenizer)} tokens")
        if not eos_token_ids:
            raise ValueError("at least one EOS id is needed")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.limits = limits or GrammarLimits()
        self._engine_limits = self.limits.engine_limits()
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(self.eos_token_ids))
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (from the cache when it holds the spec). Raises InvalidArgument with the
        engine's reason for an invalid spec or one over the limits."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
                return hit
            self._misses += 1
        spec.validate(self.limits.max_chars)
        compiled = self._compile(spec)  # outside the lock: the engine drops the GIL while it builds
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> "Matcher":
        return self.compile(spec).matcher()

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self.limits.cache_size)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            grammar = _engine_grammar(spec)
        except ValueError as exc:  # bad JSON, or GBNF that does not convert
            raise InvalidArgument(f"invalid {spec.kind}: {exc}", param="structured_output") from None
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._engine_limits)
        if template.is_error():
            raise InvalidArgument(f"invalid {spec.kind}: {_reason(template.get_error())}", param="structured_output")
        _check_rollback(template, spec, self.vocab_size)
        compile_ms = (time.perf_counter() - t0) * 1e3
        log.debug("compiled %s grammar (%d chars) in %.2f ms", spec.kind, len(spec.text), compile_ms)
        return CompiledGrammar(spec, template, self, compile_ms)


# JSON as json.dumps writes it: ", " and ": ", no other whitespace. With llguidance's default (any
# whitespace anywhere) a small model can spend its whole budget on newlines and tabs inside an
# object, as the test models do; vLLM's --structured-outputs-config disable_any_whitespace is the
# same choice.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _engine_grammar(spec: GrammarSpec) -> str:
    M = llguidance.LLMatcher
    if spec.kind == "json_schema":  # a schema's own "x-guidance" options override these
        return M.grammar_from_json_schema(spec.text, defaults=JSON_LAYOUT)
    if spec.kind == "json_object":
        return M.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    if spec.kind == "regex":  # \d as [0-9] (regex_to_lark's documented default, though its real one is None)
        return M.grammar_from_lark("start: /" + llguidance.regex_to_lark(spec.text, "d") + "/")
    if spec.kind == "choice":  # JSON string literals are Lark string literals
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.text)))
    return llguidance.grammar_from("grammar", spec.text)  # Lark as is, GBNF converted to Lark


def _reason(engine_message: str) -> str:
    return engine_message.replace("<non-verbose/>", "").strip()  # the tag verbose_errors=False leaves


def _check_rollback(template: llguidance.LLMatcher, spec: GrammarSpec, vocab_size: int) -> None:
    """Lexemes with max_tokens= or stop= make every rollback fail: refuse such grammars now, not mid-request.
    Consumes one allowed token and rolls it back, leaving the template at its start."""
    words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    template.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if template.is_error() or (template.is_stopped() and template.stop_reason() not in _NORMAL_STOPS):
        raise InvalidArgument(f"invalid {spec.kind}: {_reason(template.get_error()) or template.stop_reason()}",
                              param="structured_output")
    if template.is_stopped():
        return
    token = int(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[0])
    if template.try_consume_tokens([token]) == 1 and not template.rollback(1):
        raise InvalidArgument(f"{spec.kind}: grammars whose lexemes use max_tokens= or stop= cannot be rolled "
                              f"back, which speculative decoding needs ({_reason(template.get_error())})",
                              param="structured_output")


class Matcher:
    """One session's position in a compiled grammar. Not thread-safe: one session, one caller at a time.

    `consumed` counts the session's generated tokens the matcher has followed (EOS included);
    `truncate(n)` brings it back to n of them, the same absolute rollback the session's cache gets.
    `consume` raises GrammarViolation for a forbidden token, leaving the matcher as it was; an engine
    limit hit while computing a mask raises ResourceExhausted and leaves the matcher unusable.
    """

    def __init__(self, engine: llguidance.LLMatcher, vocab_size: int, eos_token_ids: Sequence[int]):
        self._m = engine
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self._consumed = 0
        self._eos_after_stop = 0  # EOS ids consumed once the grammar was complete: the engine did not record them
        self._words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)  # one packed mask per row
        self._bias: np.ndarray | None = None  # int32 [rows, vocab_size], for apply

    @property
    def consumed(self) -> int:
        return self._consumed

    def consume(self, token_ids: Sequence[int]) -> None:
        """Advance over the given tokens, all or none."""
        tokens = self._ids(token_ids)
        if not tokens:
            return
        n = 0 if self._stopped() else self._m.try_consume_tokens(tokens)
        if n < len(tokens):
            self._raise_if_broken()
            if self._m.is_stopped() and all(t in self._eos for t in tokens[n:]):
                self._eos_after_stop += len(tokens) - n
            else:
                if n and not self._m.rollback(n):
                    self._raise_if_broken()
                raise GrammarViolation(f"token {tokens[n]} at generated position {self._consumed + n} is not "
                                       f"allowed by the grammar")
        self._consumed += len(tokens)

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` consumed ones. Idempotent."""
        if not 0 <= length <= self._consumed:
            raise OutOfRange(f"cannot truncate the grammar state to {length} tokens: it has followed {self._consumed}")
        drop = self._consumed - length
        virtual = min(drop, self._eos_after_stop)
        self._eos_after_stop -= virtual
        if drop > virtual and not self._m.rollback(drop - virtual):
            self._raise_if_broken()
            raise FailedPrecondition(f"grammar rollback of {drop - virtual} tokens failed")
        self._consumed = length

    def is_accepting(self) -> bool:
        """May the output end here (is EOS allowed)?"""
        return self._stopped() or self._m.is_accepting()

    def is_stopped(self) -> bool:
        """Is the grammar complete, so that only EOS is allowed?"""
        return self._stopped()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, in order: each is the only one its position's mask allows
        (a draft needs no forward pass for them). Empty when more than one token is allowed."""
        if self._stopped():
            return list(self.eos_token_ids) if len(self.eos_token_ids) == 1 else []
        # the engine tokenizes the forced bytes with the tokenizer, which may pick an added token
        # (Qwen's <tool_call>) that the grammar, spelling the text out, does not accept: keep the
        # prefix the grammar takes
        forced = self._m.compute_ff_tokens()
        taken = self._m.try_consume_tokens(forced) if forced else 0
        if taken and not self._m.rollback(taken):
            self._raise_if_broken()
        return forced[:taken]

    def fill_bitmask(self) -> np.ndarray:
        """The packed mask of the next position: int32 [ceil(vocab_size / 32)], a view of a buffer the next
        call overwrites."""
        self._fill(0)
        return self._words[0]

    def allowed_mask(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed next (a new tensor)."""
        self._fill(0)
        return self._unpack(1)[0]

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens forbidden next to -inf, in place. logits: float [vocab_size]."""
        assert logits.shape == (self.vocab_size,), f"logits {tuple(logits.shape)} != ({self.vocab_size},)"
        self._fill(0)
        _add(logits, self._bias_rows(1)[0])

    def draft_masks(self, draft_tokens: Sequence[int]) -> torch.Tensor:
        """The masks a verify pass over k drafts needs: bool [n, vocab_size], row i the allowed tokens after
        draft_tokens[:i]. n = k + 1, or i + 1 when draft i is the first one row i forbids (that draft is
        rejected, so later rows never matter). The state is the same afterwards."""
        return self._unpack(self._fill_drafts(draft_tokens))

    def apply_draft_masks(self, logits: torch.Tensor, draft_tokens: Sequence[int]) -> int:
        """draft_masks applied in place to a verify pass's logits [k + 1, vocab_size]; returns n, the rows
        masked (rows from n on are left as they were)."""
        assert logits.shape == (len(draft_tokens) + 1, self.vocab_size), f"logits {tuple(logits.shape)}"
        n = self._fill_drafts(draft_tokens)
        _add(logits[:n], self._bias_rows(n))
        return n

    # ---------------------------------------------------------------- internals

    def _ids(self, token_ids: Sequence[int]) -> list[int]:
        # checked here: the engine stops for good on an id past its vocabulary
        tokens = [int(t) for t in token_ids]
        if tokens and not (0 <= min(tokens) and max(tokens) < self.vocab_size):
            raise InvalidArgument(f"token ids must lie in [0, {self.vocab_size}); got {tokens}")
        return tokens

    def _stopped(self) -> bool:
        return self._eos_after_stop > 0 or self._m.is_stopped()

    def _fill(self, row: int) -> None:
        words = self._words[row]
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)  # EOS ids only, once stopped
        if self._m.is_stopped():
            self._raise_if_broken()

    def _raise_if_broken(self) -> None:
        if self._m.is_error():
            raise ResourceExhausted(f"grammar engine error: {_reason(self._m.get_error())}")
        reason = self._m.stop_reason()
        if self._m.is_stopped() and reason not in _NORMAL_STOPS:
            raise ResourceExhausted(f"the grammar engine gave up at generated position {self._consumed}: {reason} "
                                    f"(bounded by --grammar-step-lexer-fuel, --grammar-step-max-items)")

    def _fill_drafts(self, draft_tokens: Sequence[int]) -> int:
        draft_tokens = self._ids(draft_tokens)
        k = len(draft_tokens)
        if self._words.shape[0] < k + 1:
            self._words = np.zeros((k + 1, self._words.shape[1]), dtype=np.int32)
        advanced, rows = 0, k + 1
        try:
            for i in range(k + 1):
                self._fill(i)
                if i == k:
                    break
                t = draft_tokens[i]
                if self._m.is_stopped() or self._eos_after_stop:
                    if t in self._eos:  # complete: an EOS keeps it complete, the next row is EOS-only again
                        continue
                    rows = i + 1
                    break
                if self._m.try_consume_tokens([t]) != 1:
                    self._raise_if_broken()
                    rows = i + 1
                    break
                advanced += 1
        finally:
            if advanced and not self._m.rollback(advanced):
                self._raise_if_broken()
        return rows

    def _unpack(self, rows: int) -> torch.Tensor:
        bits = np.unpackbits(self._words[:rows].view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)

    def _bias_rows(self, rows: int) -> np.ndarray:
        """float32 [rows, vocab_size]: 0 where allowed, -inf where forbidden. Branch-free: a forbidden bit
        times 0xFF800000 is -inf's bit pattern (masked_fill_ branches per element, slow on mixed masks:
        docs/benchmarks/grammar-engines/)."""
        if self._bias is None or self._bias.shape[0] < rows:
            self._bias = np.empty((rows, self.vocab_size), dtype=np.int32)
        forbidden = np.unpackbits(np.invert(self._words[:rows]).view(np.uint8), axis=1, count=self.vocab_size,
                                  bitorder="little")
        bias = self._bias[:rows]
        np.multiply(forbidden, np.int32(_NEG_INF_BITS), out=bias, casting="unsafe")
        return bias.view(np.float32)


def _add(logits: torch.Tensor, bias: np.ndarray) -> None:
    """logits += bias in place. CPU float32/float64 rows go through numpy: one thread, no OpenMP region,
    so no wait for a busy core (a vocabulary-wide torch op can wait milliseconds for one; the numpy add
    takes microseconds: docs/benchmarks/grammar-engines/)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        rows = logits.detach().numpy()  # shares memory, views included
        np.add(rows, bias, out=rows)
    else:
        logits.add_(torch.from_numpy(bias).to(logits.device))


def compiler_ready(owner) -> None:
    """Waits for the GrammarCompiler `owner` (a decoder or a worker engine) makes in the background
    at start-up (seconds of CPU for a 150k vocabulary), before its server says SERVING, so that the
    compiler's thread does not take the cores and the interpreter from the first requests' passes
    (docs/benchmarks/fresh-users/). A compiler that cannot be made is logged; grammar requests then
    report it, and the rest are unaffected."""
    try:
        owner.grammar_compiler()
    except Exception:  # noqa: BLE001
        logging.getLogger(__name__).warning("no grammar compiler: structured output will fail", exc_info=True)
