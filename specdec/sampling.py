"""Logits processing, shared by both workers: logits in, a CompactProbs (specdec/protocol.py) out.

The draft computes q and the target computes p with the same `process_logits`, so the
rejection test compares like with like (temperature, then top-k, then top-p, in the order
transformers applies them). A processed distribution is kept as `CompactProbs`: sparse
(indices + probabilities) when truncation leaves few tokens, dense otherwise, whichever is
smaller on the wire. Probabilities are float32 on both sides of the wire, and the draft samples
from exactly the values it sends, so the orchestrator tests against the q that was drawn from.

This module owns no model, no gRPC server and no session state.
"""

from __future__ import annotations

import torch

from specdec.protocol import CompactProbs, SamplingParams

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
    """Temperature, top-k and top-p applied to one position's logits [n].

    n is vocab_size, or less for a draft whose output head covers only the first n token ids.

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (a token is
    kept when the mass of the tokens ranked above it is below top_p), as transformers'
    TopPLogitsWarper does; at least one token always survives.
    """
    assert logits.dim() == 1, logits.shape
    assert not params.greedy, "greedy decoding needs no distribution"
    n = logits.numel()
    vocab_size = vocab_size or n
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < n:
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
