"""Scores a round's drafts with one forward pass of the target model.

The pass runs over the tokens the target has not cached yet (the previous round's recovered or
bonus token, or the prompt's last token) followed by the gamma drafts, and keeps logits for the
last gamma + 1 positions only: position i predicts draft i, the last is the bonus position.
"""

from __future__ import annotations

import time

from specdec.errors import InvalidArgument
from specdec.protocol import MAX_GAMMA, SamplingParams, Verification
from specdec.sampling import process_logits
from specdec.worker.engine import WorkerEngine


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
            argmax, probs = self.run(session, len(draft_token_ids) + 1, "verify",
                                     lambda logits: self._score(logits, params))
            return Verification(argmax, probs, len(session.tokens), time.perf_counter() - t0,
                                session.last_pass_rows, session.last_pass_s)

    def _score(self, logits, params: SamplingParams):
        """logits: [gamma + 1, vocab] -> (argmax, None) greedy, else (None, p per position)."""
        if params.greedy:
            return logits.argmax(dim=-1).tolist(), None
        return None, [process_logits(row, params, self.vocab_size) for row in logits]
