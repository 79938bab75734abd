"""The orchestrator <-> worker hop: the records only the workers and the orchestrator's worker side use.

CompactProbs (one position's distribution on the wire), Proposal (a draft token with its q),
Verification (the target's verdict on a round), ModelInfo (what a worker serves, from Describe),
DraftOptions (how a draft proposes), ProposeCall and VerifyCall (one session's call inside a
batch) and call_status/error_from_status (a batched call's outcome), with their proto
converters; the hop's message limit WORKER_MAX_MESSAGE_BYTES. Servicers and clients of the
worker services convert with the functions here and nowhere else.

What a client request carries (GenerationRequest, SamplingParams, GrammarSpec, the request's
limits and the converters of the client hop) lives in specdec/protocol.py: this module imports
it for SamplingParams and MAX_GAMMA, and specdec/protocol.py never imports this one.

This module imports neither torch nor transformers at import time: CompactProbs holds tensors
made elsewhere (specdec/sampling.py) and imports torch only to read one off the wire. It owns no
model, no server and no session state.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from specdec.errors import InvalidArgument, ServiceError, from_status, status_of
from specdec.protocol import MAX_GAMMA, SamplingParams
from specdec.v1 import common_pb2, draft_pb2

ANY_VOCABULARY = "*"  # the vocab_fingerprint of a draft that pairs with any target (a model-free one)

# Worst case on the worker hop: a dense verify response at gamma 16 is 17 x 151,936 x 4 B,
# about 10.3 MB; 64 MiB leaves room for larger vocabularies. (The client hop's limit,
# CLIENT_MAX_MESSAGE_BYTES, is the client package's.)
WORKER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


# ---- distributions (a draft's q, the target's p) ---------------------------------------------


@dataclass
class CompactProbs:
    """One position's processed distribution over vocab_size tokens.

    probs: float32 [n] when indices is None: the probabilities of token ids [0, n), n <= vocab_size
    (a draft with a restricted output head scores only the first ids; the rest have probability 0);
    else float32 [n] for the int64 [n] token ids in indices (every other token has probability 0).
    Sparse when truncation (top-k, top-p) leaves few tokens, dense otherwise: whichever is smaller
    on the wire. The draft samples from exactly the values it sends.
    """

    vocab_size: int
    probs: Any  # torch.Tensor
    indices: Any = None  # torch.Tensor | None

    def __post_init__(self):
        assert str(self.probs.dtype) == "torch.float32" and self.probs.dim() == 1, self.probs.shape
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

    def dense(self):
        """float32 [vocab_size]; allocates only for the sparse or the shortened dense form."""
        if self.indices is None and self.probs.numel() == self.vocab_size:
            return self.probs
        out = self.probs.new_zeros(self.vocab_size)
        if self.indices is None:
            out[: self.probs.numel()] = self.probs
        else:
            out[self.indices] = self.probs
        return out

    def sample(self, generator) -> int:
        i = int(self.probs.multinomial(1, generator=generator))
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


def _le_bytes(t, dtype: str) -> bytes:
    return t.detach().cpu().numpy().astype(dtype, copy=False).tobytes()


def _from_le_bytes(data: bytes, dtype: str):
    """A tensor over the received bytes without copying them (it is never written to)."""
    import torch  # only the side that reads distributions (the orchestrator) needs it

    torch_dtype = {"<f4": torch.float32, "<i4": torch.int32, "<i2": torch.int16}[dtype]
    if not data:
        return torch.empty(0, dtype=torch_dtype)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        import numpy as np

        return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype)).astype(dtype[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(data, dtype=torch_dtype)


# ---- worker records (orchestrator <-> workers) -----------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    vocab_size: int
    vocab_fingerprint: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    pad_token_id: int
    max_context: int
    device: str
    dtype: str
    max_gamma: int = MAX_GAMMA
    open_sessions: int = 0
    draining: bool = False
    held_tokens: int = 0
    kernels: str = ""  # the code its passes run on (worker/runner.py, kernels_in_use)
    draft_kind: str = ""  # a draft's: "model", "eagle3" (a feature head) or "ngram"; "" on a target
    feature_layers: tuple[int, ...] = ()  # a feature head's: the target layers whose input stream it reads
    feature_size: int = 0  # a feature head's: the width of one position's features
    num_layers: int = 0  # a target's decoder layers ...
    hidden_size: int = 0  # ... and hidden size: what a feature head must fit
    host_id: str = ""  # where it runs (specdec/hardware.py): its machine's boot id ...
    cpus: tuple[int, ...] = ()  # ... the CPUs its passes may use (none on a GPU) ...
    device_uuid: str = ""  # ... and its GPU's UUID: whether a draft and a target share hardware

    def to_proto(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(**{**self.__dict__, "eos_token_ids": list(self.eos_token_ids),
                                       "feature_layers": list(self.feature_layers), "cpus": list(self.cpus)})

    @classmethod
    def from_proto(cls, msg: common_pb2.ModelInfo) -> "ModelInfo":
        return cls(**{f: getattr(msg, f) for f in cls.__dataclass_fields__}
                   | {"eos_token_ids": tuple(msg.eos_token_ids), "feature_layers": tuple(msg.feature_layers),
                      "cpus": tuple(msg.cpus)})


@dataclass
class Features:
    """A target's hidden states for a feature head (specdec/eagle3.py): rows [n, width] for the
    positions start .. start + n - 1, each the residual stream entering the head's feature layers,
    side by side. bfloat16 on the wire (what heads are trained on), float32 once received."""

    start: int
    rows: Any  # torch.Tensor [n, width]

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]

    def to_proto(self) -> common_pb2.Features:
        import torch

        rows = self.rows.detach().to("cpu", torch.bfloat16).contiguous()
        return common_pb2.Features(start=self.start, rows=rows.shape[0], width=rows.shape[1],
                                   bfloat16_le=_le_bytes(rows.view(torch.int16), "<i2"))  # numpy has no bfloat16

    @classmethod
    def from_proto(cls, msg: common_pb2.Features) -> "Features | None":
        """None for an absent message (no rows, no width)."""
        if not msg.rows and not msg.width:
            return None
        import torch

        if len(msg.bfloat16_le) != 2 * msg.rows * msg.width:
            raise InvalidArgument(f"features of {msg.rows} x {msg.width} values need {2 * msg.rows * msg.width} "
                                  f"bytes, got {len(msg.bfloat16_le)}")
        raw = _from_le_bytes(msg.bfloat16_le, "<i2")  # read in place, then one float32 copy
        return cls(msg.start, raw.view(torch.bfloat16).float().reshape(msg.rows, msg.width))

    def between(self, start: int, end: int) -> "Features":
        """The rows of positions [start, end), which these must hold."""
        assert self.start <= start <= end <= self.end, (self.start, self.end, start, end)
        return Features(start, self.rows[start - self.start: end - self.start])

    def joined(self, later: "Features | None") -> "Features":
        """These rows up to later.start, then later's (later may start before these end)."""
        if later is None:
            return self
        import torch

        if later.start > self.end:
            raise ValueError(f"features from {later.start} do not continue those ending at {self.end}")
        if later.start <= self.start:
            return later
        return Features(self.start, torch.cat([self.rows[: later.start - self.start], later.rows]))


@dataclass(frozen=True)
class DraftOptions:
    """How a draft proposes, chosen by the orchestrator and sent with every Propose.

    p_min: stop proposing once the draft's probability of the token it just proposed is below
      this (after min_drafts), as llama.cpp's --draft-p-min: an unsure draft is likely rejected,
      and the steps after it more so. 0 never stops early.
    lookup: the longest n-gram to look up in the sequence (specdec/ngram.py): a model draft checks
      the tokens that followed its last occurrence in one pass; 0 does not look.
    ahead: tokens the draft keeps drafting past a call's last proposal while the target verifies
      (the first is its guess of the bonus token); the next call takes them when the round kept
      every draft and the bonus is that guess. Pays only where the draft has cores of its own.
    """

    p_min: float = 0.0
    min_drafts: int = 1
    lookup: int = 0
    ahead: int = 0

    def validate(self) -> "DraftOptions":
        if not 0.0 <= self.p_min <= 1.0 or not math.isfinite(self.p_min):
            raise InvalidArgument(f"p_min must lie in [0, 1], got {self.p_min}")
        if not 1 <= self.min_drafts <= MAX_GAMMA:
            raise InvalidArgument(f"min_drafts must lie in [1, {MAX_GAMMA}], got {self.min_drafts}")
        if not 0 <= self.lookup <= 8:
            raise InvalidArgument(f"lookup (the longest n-gram) must lie in [0, 8], got {self.lookup}")
        if not 0 <= self.ahead <= 2 * MAX_GAMMA:
            raise InvalidArgument(f"ahead must lie in [0, {2 * MAX_GAMMA}], got {self.ahead}")
        return self

    def to_proto(self) -> draft_pb2.DraftOptions:
        return draft_pb2.DraftOptions(p_min=self.p_min, min_drafts=self.min_drafts, lookup=self.lookup,
                                      ahead=self.ahead)

    @classmethod
    def from_proto(cls, msg: draft_pb2.DraftOptions) -> "DraftOptions":
        return cls(msg.p_min, msg.min_drafts or 1, msg.lookup, msg.ahead)  # skip_*: deprecated, ignored


@dataclass
class Proposal:
    """One draft token of a round, with q (the draft's distribution there). probs is None when
    greedy, and, when sampling, for a proposal q puts all its mass on (a lookup's guess)."""

    index: int
    token_id: int
    probs: CompactProbs | None
    compute_s: float
    # on the last proposal of a call only (0 before): the mean, over its steps, of the tokens of
    # all sessions in the forward pass each step ran in, and of the seconds those passes took
    batch_rows: int = 0
    pass_s: float = 0.0
    wire_bytes: int = 0  # filled in by the gRPC client


@dataclass
class Verification:
    """The target's verdict on a round: gamma + 1 positions (the last is the bonus position)."""

    argmax: list[int] | None  # [gamma + 1], the target's own token (greedy: argmax; coupled: its draw)
    probs: list[CompactProbs] | None  # [gamma + 1], rejection sampling only
    length: int  # tokens the session holds after the call
    compute_s: float
    batch_rows: int = 0  # tokens of all sessions in the forward pass the verify ran in
    pass_s: float = 0.0  # the seconds that pass took (the model alone: no queueing, no lock wait)
    wire_bytes: int = 0  # filled in by the gRPC client
    # asked for logprobs: [gamma + 1] each. Greedy: the argmax's log-probability; sampling: c
    # with log P(t) = temperature * log p(t) + c for every t that p can emit
    logprob_bases: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None  # (ids, log-probabilities), most likely first
    # rejection sampling under decoding controls, with logprobs: [gamma + 1] logsumexp of the raw
    # logits; the controlled logit of t is temperature * log p(t) + base + norm
    raw_log_norms: list[float] | None = None
    # a session opened with feature_layers: the features of every position the pass ran
    features: Features | None = None

    def logprob(self, position: int, token_id: int, params: "SamplingParams", prefix: list[int] = ()) -> float:
        """The target model's raw log-probability of a token this round emits at `position`, whose
        prefix is `prefix` (needed only to undo decoding controls)."""
        if params.deterministic:  # a greedy or coupled round emits only the target's own token
            return self.logprob_bases[position]
        p = self.probs[position].prob_of(token_id)
        if p <= 0:
            return -math.inf
        if params.processed_logprobs:  # the distribution the token was drawn from
            return math.log(p)
        if not self.raw_log_norms:
            return params.temperature * math.log(p) + self.logprob_bases[position]
        norm = self.raw_log_norms[position]
        controlled = params.temperature * math.log(p) + self.logprob_bases[position] + norm
        return params.raw_logit(controlled, token_id, list(prefix)) - norm


@dataclass(frozen=True)
class ProposeCall:
    """One session's Propose inside a batch (DraftWorker.propose_batch, the ProposeBatch RPC)."""

    session_id: str
    start: int
    token_ids: list[int]
    gamma: int
    params: SamplingParams
    seed: int
    options: DraftOptions = DraftOptions()
    # a feature head's: the target's features of the positions before each of token_ids
    # (max(start, 1) - 1 .. start + len(token_ids) - 2)
    features: Features | None = None


@dataclass(frozen=True)
class VerifyCall:
    """One session's Verify inside a batch (TargetWorker.verify_batch, the VerifyBatch RPC)."""

    session_id: str
    start: int
    token_ids: list[int]
    draft_token_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None = None


def call_status(exc: BaseException | None) -> common_pb2.CallStatus:
    """A batched call's outcome on the wire: OK, or the status its exception travels as."""
    if exc is None:
        return common_pb2.CallStatus(code=0)
    code, message = status_of(exc)
    return common_pb2.CallStatus(code=code.value[0], message=message)


def error_from_status(msg: common_pb2.CallStatus, peer: str) -> ServiceError | None:
    """The ServiceError a batched call's status stands for (None for OK), as from_rpc_error."""
    return None if msg.code == 0 else from_status(msg.code, msg.message, peer)
