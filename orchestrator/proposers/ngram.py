"""A draft with no model: each round proposes what followed the sequence's last n-gram before.

`python -m orchestrator --draft ngram` drafts with this, in the orchestrator's process: no draft
worker, no draft model, no network hop, and a draft step that costs microseconds
(specdec/ngram.py finds the guesses). Where the last n-gram never occurred before, a round
proposes nothing and runs as gamma 0. It pays where answers repeat their prompt (code edits,
refactors, quoting); on fresh text it mostly finds nothing, at no cost.

Each proposal's q is a point mass on the proposal (sent as no probs): the rejection test then
keeps x_i with probability p_i(x_i) and on rejection draws from p_i without x_i, renormalized
(orchestrator/rejection_sampler.py), so sampled output keeps the target's distribution exactly.
It implements orchestrator.workers.DraftWorker, as the draft engine does.
"""

from __future__ import annotations

import threading
from typing import Iterator

from specdec import ngram
from specdec.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ServiceError
from specdec.protocol import MAX_GAMMA, SamplingParams
from specdec.wire import ANY_VOCABULARY, DraftOptions, ModelInfo, Proposal, ProposeCall

NGRAM_MODEL = "ngram"


class NgramDraft:
    address = "in-process-ngram"

    def __init__(self, max_ngram: int = ngram.MAX_NGRAM, max_sessions: int = 4096):
        self.max_ngram = max_ngram
        self.max_sessions = max_sessions
        self._sessions: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def describe(self) -> ModelInfo:
        with self._lock:
            n = len(self._sessions)
        return ModelInfo(model_name=NGRAM_MODEL, vocab_size=0, vocab_fingerprint=ANY_VOCABULARY, eos_token_ids=(),
                         bos_token_id=-1, pad_token_id=-1, max_context=2**31 - 1, device="none", dtype="none",
                         open_sessions=n, draft_kind="ngram")

    def open_session(self, session_id: str, token_ids: list[int], scope: str = "") -> tuple[int, float, int]:
        with self._lock:
            if session_id in self._sessions:
                raise AlreadyExists(f"session {session_id} is already open")
            self._sessions[session_id] = list(token_ids)
        return len(token_ids), 0.0, 0

    def fork_session(self, session_id: str, parent_id: str, token_ids: list[int]) -> tuple[int, float, int]:
        return self.open_session(session_id, token_ids)  # nothing to copy: the tokens are the session

    def _tokens(self, session_id: str) -> list[int]:
        tokens = self._sessions.get(session_id)
        if tokens is None:
            raise NotFound(f"no open session {session_id!r} on the n-gram draft")
        return tokens

    def truncate(self, session_id: str, length: int) -> int:
        with self._lock:
            tokens = self._tokens(session_id)
            del tokens[length:]
            return len(tokens)

    def close_session(self, session_id: str) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise NotFound(f"no open session {session_id!r} on the n-gram draft")

    def propose(self, session_id: str, start: int, token_ids: list[int], gamma: int, params: SamplingParams,
                seed: int, options: DraftOptions = DraftOptions(), features=None) -> Iterator[Proposal]:
        """Up to gamma tokens that followed the last n-gram before (none when it never occurred)."""
        if not 1 <= gamma <= MAX_GAMMA:
            raise InvalidArgument(f"gamma must lie in [1, {MAX_GAMMA}] for a proposal, got {gamma}")
        with self._lock:
            tokens = self._tokens(session_id)
            if start > len(tokens):
                raise FailedPrecondition(f"session {session_id} holds {len(tokens)} tokens; a call cannot start "
                                         f"at position {start}")
            del tokens[start:]
            tokens.extend(token_ids)
            guess = ngram.lookup(tokens, gamma, options.lookup or self.max_ngram)
            tokens.extend(guess)  # as a model draft's session does: the next call truncates what failed
        for i, token in enumerate(guess):
            last = i == len(guess) - 1
            yield Proposal(i, token, None, 0.0, 1 if last else 0, 0.0)

    def propose_batch(self, calls: list[ProposeCall]) -> list[list[Proposal] | ServiceError]:
        """Each call's proposals (no model, nothing to share), or the error it raised."""
        results: list = []
        for c in calls:
            try:
                results.append(list(self.propose(c.session_id, c.start, c.token_ids, c.gamma, c.params, c.seed,
                                                 c.options)))
            except ServiceError as exc:
                results.append(exc)
        return results
