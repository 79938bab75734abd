"""Logits processing, shared by both workers: logits in, a CompactProbs (specdec/wire.py) out.

The decoding controls (logit_bias, min_tokens, penalties: `apply_controls`) come first, at every
position with the prefix it sees. The draft computes q and the target computes p with the same
`process_logits`, so the rejection test compares like with like (temperature, then min-p, top-k
and top-p). A processed distribution is kept as `CompactProbs`: sparse
(indices + probabilities) when truncation leaves few tokens, dense otherwise, whichever is
smaller on the wire. Probabilities are float32 on both sides of the wire, and the draft samples
from exactly the values it sends, so the orchestrator tests against the q that was drawn from.

Coupled sampling (`coupled_choice`): a request with a seed draws each token by Gumbel-max with
noise that is a fixed function of (seed, position, token id), so that the token at a position is
the same whoever computes it: the draft's proposal and the target's own choice share the noise,
and the output equals plain target decoding with that seed for any gamma, batch or draft.

This module owns no model, no gRPC server and no session state.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.protocol import SamplingParams
from specdec.wire import CompactProbs

TOP_P_CANDIDATES = 2048  # sorting 152k logits per position costs ~10 ms; a top-k of 2k ~1 ms


def _top_p_candidates(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The most likely tokens, sorted, enough to reach top_p, and log of the normaliser of the
    whole distribution: the top 2048 when they carry that mass (the usual case), else the whole
    sorted vocabulary. Masses are taken against the whole distribution, so the nucleus is the same
    either way."""
    log_norm = torch.logsumexp(scores, -1)
    if scores.numel() > TOP_P_CANDIDATES:
        values, indices = scores.topk(TOP_P_CANDIDATES)
        if float(torch.exp(values - log_norm).sum()) >= top_p:
            return values, indices, log_norm
    values, indices = scores.sort(descending=True)
    return values, indices, log_norm


def process_logits(logits: torch.Tensor, params: SamplingParams, vocab_size: int | None = None) -> CompactProbs:
    """Temperature, min-p, top-k and top-p applied to one position's logits [n] (the decoding
    controls, when the request has any, already applied: apply_controls).

    n is vocab_size, or less for a draft whose output head covers only the first n token ids.

    Min-p keeps the tokens with at least min_p times the most likely token's probability (vLLM's
    order: after temperature, before top-k and top-p). Top-p keeps the smallest set of most likely
    tokens whose mass reaches top_p (a token is kept when the mass of the tokens ranked above it is
    below top_p), as transformers' TopPLogitsWarper does; at least one token always survives.
    """
    assert logits.dim() == 1, logits.shape
    assert not params.greedy, "greedy decoding needs no distribution"
    n = logits.numel()
    vocab_size = vocab_size or n
    scores = logits.float() / params.temperature
    if params.min_p > 0.0:
        # p(v) >= min_p * p_max  <=>  s(v) >= s_max + log(min_p); the survivors, sorted
        indices = (scores >= scores.max() + math.log(params.min_p)).nonzero()[:, 0]
        values, order = scores[indices].sort(descending=True)
        indices = indices[order]
        if params.top_k and params.top_k < values.numel():
            values, indices = values[: params.top_k], indices[: params.top_k]
        log_norm = torch.logsumexp(values, -1)
    elif params.top_k and params.top_k < n:
        values, indices = scores.topk(params.top_k)  # sorted, descending
        log_norm = torch.logsumexp(values, -1)  # top-p applies to the top-k distribution
    elif params.top_p < 1.0:
        values, indices, log_norm = _top_p_candidates(scores, params.top_p)
    else:
        return CompactProbs(vocab_size, torch.softmax(scores, dim=-1).cpu())
    if params.top_p < 1.0:
        probs = torch.exp(values - log_norm)
        mass_above = probs.cumsum(-1) - probs  # exclusive cumulative mass, [n]
        keep = int((mass_above < params.top_p).sum().clamp(min=1))
        values, indices = values[:keep], indices[:keep]
    probs = torch.softmax(values, dim=-1)
    if probs.numel() * 8 >= n * 4:  # sparse would be larger than dense on the wire
        return CompactProbs(vocab_size, probs.new_zeros(n).index_copy_(0, indices, probs).cpu())
    return CompactProbs(vocab_size, probs.cpu(), indices.cpu())


# ---- decoding controls: logit_bias, min_tokens, penalties (vLLM's semantics) -------------------
#
# Each is a function of a position's logits and of the prefix it sees. Both workers apply them at
# every position they score, the round's drafts included in the prefix (the target's verify pass
# scores gamma + 1 positions, row i seeing the drafts before it), so q and p are the controlled
# distributions and greedy, coupled and rejection sampling stay exact for the controlled target.


def _bias(params: SamplingParams, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([t for t, _ in params.logit_bias if t < n], dtype=torch.long)
    return ids, torch.tensor([b for t, b in params.logit_bias if t < n], dtype=torch.float32)


def apply_controls(logits: torch.Tensor, params: SamplingParams, tokens: list[int], first: int,
                   grammar=None) -> torch.Tensor:
    """logits: float32 [rows, n], row i the logits at absolute position first + i, whose prefix is
    tokens[:first + i] (tokens holds at least first + rows - 1 of them). Changed in place, in
    vLLM's order: the grammar's masks (grammar: a specdec.grammar.Matcher at position first; row i
    masked by its state after tokens[first:first + i]; rows after a token it forbids are left as
    they are, since that token is rejected); logit_bias added; min_tokens: the stop tokens at -inf on the first min_tokens
    output positions (never leaving a row with no token); repetition_penalty over the prefix
    (prompt and output: a positive logit divided, a negative one multiplied); frequency and
    presence penalties over the output (positions output_start on). Returns logits."""
    rows, n = logits.shape
    if grammar is not None:
        drafts = tokens[first : first + rows - 1]
        if n == grammar.vocab_size:
            grammar.apply_draft_masks(logits, drafts)
        else:  # a draft whose head scores only the first n ids
            masks = grammar.draft_masks(drafts)
            logits[: masks.shape[0]].masked_fill_(~masks[:, :n], -math.inf)
    if params.logit_bias:
        ids, bias = _bias(params, n)
        logits[:, ids] += bias
    if params.min_tokens and params.stop_token_ids:
        stop = torch.tensor([t for t in params.stop_token_ids if t < n], dtype=torch.long)
        for i in range(rows):
            if first + i - params.output_start < params.min_tokens:
                row = logits[i]
                held = row[stop].clone()
                row[stop] = -math.inf
                if not bool(torch.isfinite(row).any()):  # nothing else allowed here: min_tokens yields
                    row[stop] = held
    rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if rep == 1.0 and freq == 0.0 and pres == 0.0:
        return logits
    prefix = torch.tensor(tokens[: first + rows - 1], dtype=torch.long)
    seen = torch.unique(prefix[:first]) if rep != 1.0 else None
    out_ids, out_counts = torch.unique(prefix[params.output_start : first], return_counts=True)
    for i in range(rows):
        row, drafts = logits[i], prefix[first : first + i]  # the round's tokens before position first + i
        if rep != 1.0:
            ids = torch.unique(torch.cat([seen, drafts])) if i else seen
            ids = ids[ids < n]
            v = row[ids]
            row[ids] = torch.where(v > 0, v / rep, v * rep)
        if freq != 0.0 or pres != 0.0:
            if i:
                ids, inverse = torch.unique(torch.cat([out_ids, drafts]), return_inverse=True)
                counts = torch.zeros(ids.numel(), dtype=out_counts.dtype).index_add_(
                    0, inverse, torch.cat([out_counts, torch.ones(i, dtype=out_counts.dtype)]))
            else:
                ids, counts = out_ids, out_counts
            keep = ids < n
            ids, counts = ids[keep], counts[keep]
            row[ids] -= freq * counts.float() + pres
    return logits


# ---- coupled sampling: Gumbel-max with noise keyed by (seed, position, token id) ----------------
#
# The token at absolute position t (the index it gets in the sequence, prompt included) is
# argmax_v p_t(v) / E(seed, t, v), with E(seed, t, .) independent Exp(1) draws: the exponential
# race, the same argmax as log p_t(v) + Gumbel(seed, t, v), so an exact draw from p_t. E comes
# from a counter-based hash, not a generator's state: integers only up to the last step (one
# float64 log), the same bits on every host whatever the batch, device or process, and the draft
# and the target draw a position's token from the same E. Daliri, Musco & Suresh (2025, "Coupling
# without communication and drafter-invariant speculative decoding") show the two argmaxes agree
# with probability at least (1 - TV(p, q)) / (1 + TV(p, q)); rejection sampling's is 1 - TV.

_U32 = np.uint32


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 (Chris Wellons' hash-prospector): a bijection on uint32 with near-ideal
    avalanche; in place, wrapping multiplication (defined for numpy's unsigned integers)."""
    x ^= x >> _U32(16)
    x *= _U32(0x7FEB352D)
    x ^= x >> _U32(15)
    x *= _U32(0x846CA68B)
    x ^= x >> _U32(16)
    return x


def _position_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for (seed, position): splitmix64's finalizer over seed + (position + 1) *
    the golden ratio, in Python's exact integers. seed is taken modulo 2**64."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & 0xFFFFFFFF, z >> 32


def coupling_exponentials(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """E(seed, position, v) ~ Exp(1), float64, for each v in token_ids (uint32 [k]), independent
    across v and positions: two rounds of the hash keyed by the position's keys, a uniform in
    (0, 1) on a 2**-32 grid, -log of it."""
    k1, k2 = _position_key(seed, position)
    h = token_ids ^ _U32(k1)
    _mix32(h)
    h ^= _U32(k2)
    _mix32(h)
    e = h.astype(np.float64)  # the one float array: the rest in place
    e += 0.5
    e *= 2.0**-32
    np.log(e, out=e)
    return np.negative(e, out=e)


_ARANGE = np.arange(0, dtype=np.uint32)


def _ids(n: int) -> np.ndarray:
    global _ARANGE
    if _ARANGE.size < n:  # grown once to the largest vocabulary seen; read-only slices after
        _ARANGE = np.arange(n, dtype=np.uint32)
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


def coupled_choice(probs: CompactProbs, seed: int, position: int) -> int:
    """The token at `position` drawn from `probs` with the request's noise: argmax p(v) / E(v)
    over p's support (a token of probability 0 never wins)."""
    p = probs.probs.numpy()  # float32; divided by float64 noise, the scores are float64
    ids = _ids(p.size) if probs.indices is None else probs.indices.numpy().astype(np.uint32)
    e = coupling_exponentials(seed, position, ids)
    i = int(np.argmax(np.divide(p, e, out=e)))
    return i if probs.indices is None else int(ids[i])


def seeded_choice(probs: CompactProbs, seed: int, tokens: list[int], position: int) -> int:
    """A draw from `probs` for `position`, a function of the seed and the context tokens[:position]
    alone: the exponential race of coupled_choice, its noise keyed by the seed and a hash of the
    context. A draft's sampled proposal: the same request makes the same proposal in a context
    whichever call or job drafts it, and a context that differs anywhere (a position drafted again
    after a rejection) draws anew. (Python's hash of a tuple of ints is the same in every run.)"""
    context = hash(tuple(tokens[:position])) * 0xD1B54A32D192ED03
    return coupled_choice(probs, (seed + context) & 0xFFFFFFFFFFFFFFFF, position)


# ---- the same choices on the device: a chain of draft steps (specdec/worker/paged.py) ----------
#
# A chain replays a draft's one-row passes back to back with no host step in between, so each
# step's token is chosen on the device: greedy rows by argmax, coupled rows by the exponential
# race above over process_logits' distribution (temperature, min-p, top-k, top-p as masks over
# the whole row). The noise's integer steps are exact in int64 (each uint32 product split in two
# so none leaves int64's range); its one float64 log and the masked softmax may round otherwise
# than the host's, which can change a draft's choice only where two tokens tie to the last bit. A
# draft's choice is a proposal: the target's own choice decides the output either way.


def _mul32_on(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x int64 holding uint32 values (c's 16-bit halves: no product overflows)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32_on(x: torch.Tensor) -> torch.Tensor:
    """_mix32 over int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32_on(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32_on(x, 0x846CA68B)
    return x ^ (x >> 16)


def coupling_exponentials_on(keys: torch.Tensor, n: int) -> torch.Tensor:
    """coupling_exponentials for token ids 0..n-1 at m positions at once, on keys' device:
    keys int64 [m, 2], each position's _position_key -> E float64 [m, n]."""
    h = _mix32_on(torch.arange(n, device=keys.device) ^ keys[:, :1])
    h = _mix32_on(h ^ keys[:, 1:])
    return h.double().add_(0.5).mul_(2.0**-32).log_().neg_()


class DeviceChoices:
    """How each of a chain's rows chooses its token on the device, and the draft's probability of
    it: `choose(logits [m, n], k)` for the first m rows at their k-th choice. The per-row settings
    and the noise keys of every (row, choice) are made on the host once, as int64 words staged
    with the chain's other inputs (`words`, then `bind` to their device copy): nothing else
    crosses to the device while the chain runs. Rows are greedy, or coupled without decoding
    controls (SamplingParams.controlled)."""

    def __init__(self, params: list[SamplingParams], positions: list[int], choices: int):
        """params: each row's; positions: the position each row's first choice takes (the k-th
        takes positions[i] + k); choices: how many each row may make."""
        assert all(p.greedy or (p.coupled and not p.controlled) for p in params)
        self.rows, self.choices = len(params), choices
        self.all_greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        self._params, self._positions = params, positions
        self.top_k_max = max((p.top_k for p in params if not p.greedy), default=0)
        self.min_p = any(p.min_p > 0 for p in params if not p.greedy)
        self.top_p = any(p.top_p < 1 for p in params if not p.greedy)

    def words(self) -> np.ndarray:
        """What bind reads, as int64: keys [choices, rows, 2], then per row greedy, top-k, and
        the float64 bits of temperature, log min-p and top-p (none for greedy rows alone)."""
        if self.all_greedy:
            return np.zeros(0, dtype=np.int64)
        m, k = self.rows, self.choices
        keys = np.zeros((k, m, 2), dtype=np.int64)
        for i, (p, position) in enumerate(zip(self._params, self._positions)):
            if p.coupled:
                keys[:, i] = [_position_key(p.coupling_seed, position + j) for j in range(k)]
        rows = np.zeros((2, m), dtype=np.int64)
        floats = np.zeros((3, m), dtype=np.float64)
        for i, p in enumerate(self._params):
            rows[:, i] = (p.greedy, 0 if p.greedy else p.top_k)
            # greedy rows: the plain softmax (their probability of the argmax); top-p 2: every token kept
            floats[:, i] = ((1.0, -math.inf, 2.0) if p.greedy else
                            (p.temperature, math.log(p.min_p) if p.min_p > 0 else -math.inf,
                             p.top_p if p.top_p < 1 else 2.0))
        return np.concatenate([keys.ravel(), rows.ravel(), floats.view(np.int64).ravel()])

    def bind(self, words: torch.Tensor) -> None:
        """words: the device's copy of words()."""
        if self.all_greedy:
            return
        m, k = self.rows, self.choices
        self._keys = words[:2 * k * m].view(k, m, 2)
        rows, floats = words[2 * k * m:2 * k * m + 2 * m].view(2, m), words[2 * k * m + 2 * m:].view(torch.float64)
        self._greedy, self._top_k = rows[0].bool(), rows[1]
        self._settings = floats.view(3, m).float()  # temperature, log min-p, top-p

    def choose(self, logits: torch.Tensor, k: int, probabilities: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [m, n] of the first m rows, at their k-th choice -> (tokens [m], each one's
        probability under the row's distribution (float32 [m]) if asked, else None)."""
        if self.all_greedy:
            tokens = logits.argmax(dim=-1)  # the first of equal maxima, as the draft's own choice
            if not probabilities:
                return tokens, None
            return tokens, torch.softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
        m = logits.shape[0]
        temperature, log_min_p, top_p = (s[:m, None] for s in self._settings)
        scores = logits.float() / temperature
        if self.min_p or self.top_k_max or self.top_p:
            scores = self._truncated(scores, log_min_p, self._top_k[:m, None], top_p)
        q = torch.softmax(scores, dim=-1)
        tokens = (q.double() / coupling_exponentials_on(self._keys[k, :m], logits.shape[-1])).argmax(dim=-1)
        if self.any_greedy:
            tokens = torch.where(self._greedy[:m], logits.argmax(dim=-1), tokens)
        return tokens, q.gather(1, tokens[:, None])[:, 0] if probabilities else None

    def _truncated(self, scores: torch.Tensor, log_min_p: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
        """process_logits' min-p, top-k and top-p as a mask over each row (a token tied with the
        last one kept is kept too)."""
        keep = scores >= scores.amax(dim=-1, keepdim=True) + log_min_p
        if self.top_k_max:  # a top-k of 0 keeps every token, one of n or more as well (the kth: the least)
            most = min(self.top_k_max, scores.shape[-1])
            kth = scores.topk(most, dim=-1).values.gather(1, (top_k - 1).clamp(0, most - 1))
            keep &= (scores >= kth) | (top_k == 0)
        if self.top_p:
            probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
            ranked = probs.sort(dim=-1, descending=True).values
            kept = ((ranked.cumsum(dim=-1) - ranked) < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
            keep &= probs >= ranked.gather(1, kept - 1)
        return scores.masked_fill(~keep, -math.inf)
