"""Proposes gamma draft tokens for a session, one forward pass of one token each.

Each proposal carries q, the draft's processed distribution at that position, which the
orchestrator needs for the rejection test (none in greedy mode). The proposal is drawn from
exactly the q that is returned, with a generator seeded by the request, so a retried call gives
the same proposals.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from specdec.errors import Aborted, InvalidArgument
from specdec.protocol import MAX_GAMMA, CompactProbs, Proposal, SamplingParams
from specdec.sampling import process_logits
from specdec.worker.engine import WorkerEngine


class DraftEngine(WorkerEngine):
    def propose(
        self,
        session_id: str,
        start: int,
        token_ids: list[int],
        gamma: int,
        params: SamplingParams,
        seed: int,
    ) -> Iterator[Proposal]:
        """Truncates to `start`, appends token_ids, then yields gamma proposals as they come.

        The session lock is held for each step, never across a yield (the caller may take its time
        reading a proposal); a call that changes the session in between aborts this one."""
        if not 1 <= gamma <= MAX_GAMMA:
            raise InvalidArgument(f"gamma must lie in [1, {MAX_GAMMA}] for a proposal, got {gamma}")
        params.validate()
        session = self.session(session_id)
        with session.lock:
            session.check_start(start, len(token_ids))
            self.check_tokens(token_ids, already=start)
            self.check_tokens([], already=start + len(token_ids) + gamma)
            self.grow(session, start + len(token_ids) + gamma)
            self.truncate_to(session, start)
            session.tokens.extend(token_ids)
            session.uncache_last()
            version = session.version
        generator = torch.Generator().manual_seed(seed)
        rows, seconds = 0, 0.0  # of the steps' passes, summed; the last proposal reports their means
        for index in range(gamma):
            with session.lock:
                if session.version != version:
                    raise Aborted(f"session {session_id} was changed by another call during this Propose")
                t0 = time.perf_counter()
                token, probs = self.run(session, 1, "propose", lambda logits: self._pick(logits[-1], params, generator))
                session.tokens.append(token)  # the last one stays uncached until the next round
                rows += session.last_pass_rows
                seconds += session.last_pass_s
            last = index == gamma - 1
            yield Proposal(index, token, probs, time.perf_counter() - t0, round(rows / gamma) if last else 0,
                           seconds / gamma if last else 0.0)

    def _pick(self, logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator) -> tuple[int, CompactProbs | None]:
        """logits: [vocab] -> (proposal, q); q is None when greedy."""
        if params.greedy:
            return int(logits.argmax()), None
        probs = process_logits(logits, params, self.vocab_size)
        return probs.sample(generator), probs
