"""Scores a round's drafts with one forward pass of the target model.

The pass runs over the tokens the target has not cached yet (the previous round's recovered or
bonus token, or the prompt's last token) followed by the gamma drafts, and keeps logits for the
last gamma + 1 positions only: position i predicts draft i, the last is the bonus position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.errors import InvalidArgument
from specdec.sampling import MAX_GAMMA, CompactProbs, SamplingParams, process_logits
from specdec.worker import WorkerEngine


@dataclass
class Verification:
    argmax: list[int] | None  # [gamma + 1], greedy only
    probs: list[CompactProbs] | None  # [gamma + 1], sampling only
    length: int  # tokens the session holds after the call
    compute_s: float
    wire_bytes: int = 0  # filled in by the gRPC client


class TargetEngine(WorkerEngine):
    def verify(
        self,
        session_id: str,
        start: int,
        token_ids: list[int],
        draft_token_ids: list[int],
        params: SamplingParams,
    ) -> Verification:
        if len(draft_token_ids) > MAX_GAMMA:
            raise InvalidArgument(f"at most {MAX_GAMMA} drafts per round, got {len(draft_token_ids)}")
        params.validate()
        session = self.session(session_id)
        with session.lock:
            t0 = time.perf_counter()
            session.check_start(start, len(token_ids))
            self.check_tokens([*token_ids, *draft_token_ids], already=start)
            self.grow(session, start + len(token_ids) + len(draft_token_ids))
            self.truncate_to(session, start)
            session.tokens.extend(token_ids)
            session.uncache_last()
            session.tokens.extend(draft_token_ids)
            argmax, probs = self.on_model_thread(self._score, session, len(draft_token_ids) + 1, params)
            return Verification(argmax, probs, len(session.tokens), time.perf_counter() - t0)

    def _score(self, session, positions: int, params: SamplingParams):
        logits = self.forward(session, positions, "verify")  # [gamma + 1, vocab]
        if params.greedy:
            return logits.argmax(dim=-1).tolist(), None
        return None, [process_logits(row, params, self.vocab_size) for row in logits]
