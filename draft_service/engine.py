"""Proposes gamma draft tokens for a session, one forward pass of one token each.

Each proposal carries q, the draft's processed distribution at that position, which the
orchestrator needs for the rejection test (none in greedy mode). The proposal is drawn from
exactly the q that is returned, with a generator seeded by the request, so a retried call gives
the same proposals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from specdec.errors import InvalidArgument
from specdec.sampling import MAX_GAMMA, CompactProbs, SamplingParams, process_logits
from specdec.worker import WorkerEngine


@dataclass
class Proposal:
    index: int
    token_id: int
    probs: CompactProbs | None  # q at this position; None when greedy
    compute_s: float
    wire_bytes: int = 0  # filled in by the gRPC client


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
        """Truncates to `start`, appends token_ids, then yields gamma proposals as they come."""
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
            generator = torch.Generator().manual_seed(seed)
            for index in range(gamma):
                t0 = time.perf_counter()
                token, probs = self.on_model_thread(self._step, session, params, generator)
                session.tokens.append(token)  # the last one stays uncached until the next round
                yield Proposal(index, token, probs, time.perf_counter() - t0)

    def _step(self, session, params: SamplingParams, generator: torch.Generator) -> tuple[int, CompactProbs | None]:
        logits = self.forward(session, 1, "propose")[-1]
        if params.greedy:
            return int(logits.argmax()), None
        probs = process_logits(logits, params, self.vocab_size)
        return probs.sample(generator), probs
