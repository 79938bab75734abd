"""A draft worker serving an EAGLE-3 feature head (specdec/eagle3.py; docs/architecture.md,
feature heads).

The head reads, beside each token, the target's features at the position before it (the residual
stream entering the layers it names). The target returns them for every position it runs: the
prompt's with its prefill (Placement.opened_features), every verified row's with each Verify.
This proposer keeps those the head has not taken in yet (positions draft_synced - 1 up to the last
the target validated) and sends them with the next Propose. After a round the head's states past
its first proposal were fed its own guesses instead of the target's features, so its session is
valid only up to the round's start: the next Propose takes the accepted tokens in again, with
their features (vLLM's EAGLE proposer does the same).
"""

from __future__ import annotations

from orchestrator.proposers.draft_model import DraftWorkerProposer
from specdec.wire import Features, Verification


class FeatureHeadProposer(DraftWorkerProposer):
    """One per request: it holds the request's features the head has not taken in."""

    def __init__(self, opened: Features | None):
        self.held = opened  # the target's features from position draft_synced - 1 on (None: none yet)

    def features(self, req) -> Features | None:
        """The target's features at the positions before each token the Propose brings."""
        first, end = max(req.draft_synced, 1) - 1, len(req.tokens) - 1
        return self.held.between(first, end) if end > first else None

    def synced_after(self, req) -> int:
        return len(req.tokens)  # the round's start: what came after was fed the head's own states

    def verified(self, req, verification: Verification) -> None:
        """The verify's features join those held, up to the last validated position; those the head
        has taken in are dropped."""
        if req.placement.draft is None:  # the head was dropped (a fault): nothing to keep for
            self.held = None
            return
        have = verification.features if self.held is None else self.held.joined(verification.features)
        if have is None:
            return
        first = max(req.draft_synced, 1) - 1
        self.held = have.between(max(first, have.start), min(req.target_synced, have.end))

    def target_moved(self, req) -> None:
        self.held = req.placement.opened_features  # the new target's prefill ran every position again
