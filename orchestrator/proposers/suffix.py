"""Suffix drafts: what followed the same tokens before, in this request or in an earlier one.

Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's `suffix` method): agents, batch
jobs and code edits repeat long runs of tokens, within a request (an answer quoting its prompt)
and across requests (the same tool output, the same boilerplate, a retried prompt). Where the
request's last tokens occurred before, the tokens that followed them then are a draft that costs
no draft pass: the step loop (orchestrator/steps.py) sends it straight to the target's verify, in
a step whose request would otherwise draft nothing, and the cost model (orchestrator/gamma.py,
GammaPolicy.choose_step) keeps only drafts whose expected tokens pay for their extra rows.

Where a draft comes from: the request's own tokens (prompt lookup, as specdec/ngram.py) and the
prompts and outputs of ended requests of the same scope (the client's bearer token: a tenant's
drafts never come from another tenant's text, so the time a reply takes tells nothing of what
others asked). Each occurrence of the request's last n tokens (n from MAX_NGRAM down to MIN_NGRAM,
the longest that occurred) gives a continuation; the draft follows the most frequent next token
while the path's probability (each step: that token's share of the continuations still agreeing)
stays at least MIN_TOKEN_PROB, and is never longer than SPEC_FACTOR times the matched length
(Arctic Inference's rules; a longer match earns a longer draft). Each position's path
probability goes to the cost model, which learns how far to trust it.

Bounded: at most `max_tokens` tokens of ended requests (the oldest request is forgotten first),
MAX_HITS occurrences per n-gram (the latest). Thread-safe: requests end on the step loops' threads.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from typing import Sequence

MIN_NGRAM = 2  # a single repeated token (a bracket, a newline) predicts little
MAX_NGRAM = 4  # n-grams indexed; a match is then extended backwards to its full length
MAX_MATCH = 32  # ... up to this many tokens
MAX_HITS = 16  # occurrences kept per n-gram and scope, the latest
MIN_TOKEN_PROB = 0.1  # a draft stops where its path's probability would fall below this
SPEC_FACTOR = 2.0  # a draft is at most this many times the matched length


class SuffixIndex:
    """Ended requests' token sequences per scope, found by their n-grams."""

    def __init__(self, max_tokens: int = 65536):
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._seqs: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # id -> (scope, tokens), oldest first
        self._keys: dict[str, dict[tuple[int, ...], deque]] = {}  # scope -> n-gram -> deque of (id, end)
        self._held = 0  # tokens in _seqs
        self._next_id = 0

    @property
    def tokens(self) -> int:
        return self._held

    def add(self, scope: str, tokens: Sequence[int]) -> None:
        """An ended request's prompt and output: later requests of `scope` may draft from it."""
        if self.max_tokens <= 0 or len(tokens) <= MIN_NGRAM:
            return
        seq = list(tokens[-self.max_tokens:])
        with self._lock:
            sid, self._next_id = self._next_id, self._next_id + 1
            self._seqs[sid] = (scope, seq)
            self._held += len(seq)
            keys = self._keys.setdefault(scope, {})
            for end in range(MIN_NGRAM, len(seq)):  # the n-gram seq[end - n:end], followed by seq[end]
                for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                    key = tuple(seq[end - n:end])
                    hits = keys.get(key)
                    if hits is None:
                        hits = keys[key] = deque(maxlen=MAX_HITS)
                    hits.append((sid, end))
            while self._held > self.max_tokens:
                self._forget(*self._seqs.popitem(last=False))

    def _forget(self, sid: int, entry: tuple[str, list[int]]) -> None:
        scope, seq = entry
        self._held -= len(seq)
        keys = self._keys[scope]
        for end in range(MIN_NGRAM, len(seq)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(seq[end - n:end])
                hits = keys.get(key)
                if hits is None:
                    continue
                kept = [h for h in hits if h[0] != sid]
                if not kept:
                    del keys[key]
                elif len(kept) != len(hits):
                    keys[key] = deque(kept, maxlen=MAX_HITS)
        if not keys:
            del self._keys[scope]

    def draft(self, scope: str, tokens: Sequence[int], own: "RequestIndex", k: int) -> tuple[list[int], list[float]]:
        """Up to k tokens likely to follow `tokens` (a request's prompt and output so far, indexed
        in `own`), and each one's path probability (non-increasing); ([], []) when its last
        n-gram never occurred."""
        if k <= 0 or len(tokens) <= MIN_NGRAM:
            return [], []
        own.update(tokens)
        with self._lock:
            keys = self._keys.get(scope, {})
            for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
                tail = tuple(tokens[-n:])
                found = [(tokens, end) for end in reversed(own.keys.get(tail, ()))]
                found += [(self._seqs[sid][1], end) for sid, end in reversed(keys.get(tail, ()))]
                if found:
                    return _walk(tokens, found[:MAX_HITS], k)
        return [], []


class RequestIndex:
    """One request's own tokens by their n-grams, extended as the request grows (prompt lookup
    without a rescan each step). Its tokens only grow: the orchestrator's copy holds emitted tokens."""

    def __init__(self):
        self.keys: dict[tuple[int, ...], deque] = {}  # n-gram -> ends (each followed by a token)
        self.indexed = MIN_NGRAM  # the next end to index

    def update(self, tokens: Sequence[int]) -> None:
        for end in range(self.indexed, len(tokens)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(tokens[end - n:end])
                hits = self.keys.get(key)
                if hits is None:
                    hits = self.keys[key] = deque(maxlen=MAX_HITS)
                hits.append(end)
        self.indexed = max(self.indexed, len(tokens))


def _match_length(own: Sequence[int], seq: Sequence[int], end: int) -> int:
    """How many tokens before `end` in seq equal the request's last ones (at most MAX_MATCH)."""
    m = 0
    while m < MAX_MATCH and m < end and m < len(own) and seq[end - 1 - m] == own[-1 - m]:
        m += 1
    return m


def _walk(own: Sequence[int], found: list[tuple[Sequence[int], int]], k: int) -> tuple[list[int], list[float]]:
    """The most frequent path through the occurrences' continuations."""
    longest = max(_match_length(own, seq, end) for seq, end in found)
    k = min(k, max(1, int(SPEC_FACTOR * longest)))
    live = [(seq, end) for seq, end in found if end < len(seq)]
    draft, probs, p = [], [], 1.0
    for d in range(k):
        counts = Counter(seq[end + d] for seq, end in live if end + d < len(seq))
        total = sum(counts.values())
        if not total:
            break
        token, count = counts.most_common(1)[0]
        p *= count / total
        if p < MIN_TOKEN_PROB:
            break
        draft.append(token)
        probs.append(p)
        live = [(seq, end) for seq, end in live if end + d < len(seq) and seq[end + d] == token]
    return draft, probs
