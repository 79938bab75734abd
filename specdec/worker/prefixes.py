"""Prefix caching across requests: a worker keeps the KV caches of sessions that ended and starts a
new session whose prompt begins with one of them from a copy of that prefix, instead of a prefill.

What it is for: a system prompt or tool schema every request repeats, and an agent's or a chat's
next turn, whose prompt is the last turn's prompt and answer and a little more. Prefill is the
slow part of a request on a CPU (compute-bound: seconds for a chat prompt of a few hundred tokens
on 2 cores, docs/benchmarks/prefix-cache/); copying a cached prefix costs a memory copy.

- `PrefixStore` holds retained caches by scope (the opener's certificate identity and the scope
  the orchestrator names: a digest of the request's bearer token), newest first, bounded by the
  tokens they hold together (--prefix-cache-tokens; the oldest go first). A prompt is matched only
  against its own scope's entries, so one tenant's prompts never shape another's latency.
- A retained cache is never handed out: a new session gets a copy of its first n tokens (n, the
  longest common prefix, at least MIN_PREFIX), so any number of requests may start from it.
- What a copy holds is what a prefill of the same tokens computes: every pass computes a token's
  keys and values from the tokens before it alone. On the CPU path (decoder rows one at a time in
  a fixed order) that is bitwise; where a long prefill chunk's attention runs as one call and a
  decoding row's one row at a time (transformers' own kernels, a GPU), the two differ in rounding.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

MIN_PREFIX = 16  # a shorter common prefix is prefilled: a copy would save too little


@dataclass
class Retained:
    scope: tuple[str, str]  # (the opener's certificate identity, the orchestrator's prefix scope)
    tokens: list[int]  # the tokens its cache holds, in order
    cache: object
    used: float = field(default_factory=time.monotonic)


class PrefixStore:
    """Retained KV caches of ended sessions, matched by longest common prefix within a scope."""

    def __init__(self, max_tokens: int, copy_prefix: Callable[[object, int], object], free: Callable[[object], None]):
        """copy_prefix(cache, n) -> a new cache holding its first n tokens; free(cache): give it back."""
        self.max_tokens = max_tokens
        self._copy, self._free = copy_prefix, free
        self._entries: list[Retained] = []
        self._lock = threading.Lock()
        self.hits = self.tokens_reused = 0

    @property
    def held_tokens(self) -> int:
        with self._lock:
            return sum(len(e.tokens) for e in self._entries)

    def retain(self, scope: tuple[str, str], tokens: list[int], cache) -> None:
        """Keeps an ended session's cache (tokens: what it holds). An entry whose tokens this one
        begins with is dropped (this one serves every prompt it served); the oldest go while the
        store holds more than max_tokens."""
        if len(tokens) < MIN_PREFIX or len(tokens) > self.max_tokens:
            self._free(cache)
            return
        dropped = []
        with self._lock:
            keep = []
            for e in self._entries:
                (dropped if e.scope == scope and tokens[:len(e.tokens)] == e.tokens else keep).append(e)
            keep.insert(0, Retained(scope, list(tokens), cache))
            held = sum(len(e.tokens) for e in keep)
            while held > self.max_tokens:
                oldest = min(range(len(keep)), key=lambda i: keep[i].used)
                held -= len(keep[oldest].tokens)
                dropped.append(keep.pop(oldest))
            self._entries = keep
        for e in dropped:
            self._free(e.cache)

    def copy_longest(self, scope: tuple[str, str], prompt: list[int], longer_than: int = 0) -> tuple[object, int]:
        """A copy of the scope's cache sharing the longest prefix with `prompt` (at least
        MIN_PREFIX tokens, more than longer_than), cut to that prefix -> (cache, tokens it
        holds); (None, 0) if none."""
        with self._lock:
            best, n = None, 0
            for e in self._entries:
                if e.scope != scope or not e.tokens or not prompt or e.tokens[0] != prompt[0]:
                    continue
                common = len(os.path.commonprefix([e.tokens, prompt]))
                if common > n:
                    best, n = e, common
            if best is None or n < MIN_PREFIX or n <= longer_than:
                return None, 0
            best.used = time.monotonic()
            copy = self._copy(best.cache, n)  # under the lock: eviction cannot free it meanwhile
            self.hits += 1
            self.tokens_reused += n
            return copy, n

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = self._entries, []
        for e in entries:
            self._free(e.cache)
