"""Logits processing and compact probability vectors, shared by both workers.

The draft computes q and the target computes p with the same `process_logits`, so the
rejection test compares like with like (temperature, then top-k, then top-p, in the order
transformers applies them). A processed distribution is kept as `CompactProbs`: sparse
(indices + probabilities) when truncation leaves few tokens, dense otherwise, whichever is
smaller on the wire. Probabilities are float32 on both sides of the wire, and the draft samples
from exactly the values it sends, so the orchestrator tests against the q that was drawn from.

This module owns no model, no gRPC server and no session state.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2

MAX_GAMMA = 16  # most drafts per round a request may ask for
DEFAULT_GAMMA = 4
DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_BELOW = 1e-5  # temperatures below this are greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        # as vLLM does: below 1e-5, logits / T overflows float32 and the answer is the argmax anyway
        return self.temperature < GREEDY_BELOW

    def validate(self) -> "SamplingParams":
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise InvalidArgument(f"top_p must lie in (0, 1], got {self.top_p}")
        return self

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> "SamplingParams":
        # proto3 cannot tell 0 from unset: the orchestrator always sets all three, and greedy
        # requests need neither top_k nor top_p.
        if 0 <= msg.temperature < GREEDY_BELOW:
            return cls(temperature=0.0)
        return cls(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p).validate()


@dataclass
class CompactProbs:
    """One position's processed distribution over vocab_size tokens.

    probs: float32 [n] when indices is None: the probabilities of token ids [0, n), n <= vocab_size
    (a draft with a restricted output head scores only the first ids; the rest have probability 0);
    else float32 [n] for the int64 [n] token ids in indices (every other token has probability 0).
    """

    vocab_size: int
    probs: torch.Tensor
    indices: torch.Tensor | None = None

    def __post_init__(self):
        assert self.probs.dtype == torch.float32 and self.probs.dim() == 1, self.probs.shape
        if self.indices is None:
            assert self.probs.numel() <= self.vocab_size, (self.probs.numel(), self.vocab_size)
        else:
            assert self.indices.shape == self.probs.shape, (self.indices.shape, self.probs.shape)

    @property
    def is_sparse(self) -> bool:
        return self.indices is not None

    def prob_of(self, token_id: int) -> float:
        if self.indices is None:
            return float(self.probs[token_id]) if token_id < self.probs.numel() else 0.0
        hit = (self.indices == token_id).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else 0.0

    def dense(self) -> torch.Tensor:
        """float32 [vocab_size]; allocates only for the sparse or the shortened dense form."""
        if self.indices is None:
            if self.probs.numel() == self.vocab_size:
                return self.probs
            return torch.nn.functional.pad(self.probs, (0, self.vocab_size - self.probs.numel()))
        out = torch.zeros(self.vocab_size, dtype=torch.float32)
        out[self.indices] = self.probs
        return out

    def sample(self, generator: torch.Generator) -> int:
        i = int(torch.multinomial(self.probs, 1, generator=generator))
        return i if self.indices is None else int(self.indices[i])

    def to_proto(self) -> common_pb2.Probs:
        if self.indices is None:
            return common_pb2.Probs(dense=common_pb2.DenseProbs(float32_le=_le_bytes(self.probs, "<f4")))
        return common_pb2.Probs(
            sparse=common_pb2.SparseProbs(
                vocab_size=self.vocab_size,
                indices_int32_le=_le_bytes(self.indices, "<i4"),
                probs_float32_le=_le_bytes(self.probs, "<f4"),
            )
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.Probs, vocab_size: int) -> "CompactProbs":
        form = msg.WhichOneof("form")
        if form == "dense":
            probs = _from_le_bytes(msg.dense.float32_le, "<f4")
            if probs.numel() > vocab_size:
                raise InvalidArgument(f"a dense distribution of {probs.numel()} values exceeds the vocabulary of {vocab_size}")
            return cls(vocab_size, probs)
        if form == "sparse":
            idx = _from_le_bytes(msg.sparse.indices_int32_le, "<i4").long()
            return cls(msg.sparse.vocab_size or vocab_size, _from_le_bytes(msg.sparse.probs_float32_le, "<f4"), idx)
        raise InvalidArgument("a distribution was expected but none was sent")


def _le_bytes(t: torch.Tensor, dtype: str) -> bytes:
    return t.detach().cpu().numpy().astype(dtype, copy=False).tobytes()


_TORCH_DTYPES = {"<f4": torch.float32, "<i4": torch.int32}


def _from_le_bytes(data: bytes, dtype: str) -> torch.Tensor:
    """A tensor over the received bytes without copying them (it is never written to)."""
    if not data:
        return torch.empty(0, dtype=_TORCH_DTYPES[dtype])
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype)).astype(dtype[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(data, dtype=_TORCH_DTYPES[dtype])


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
