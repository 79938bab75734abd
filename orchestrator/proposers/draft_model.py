"""A draft worker's proposals: a small model on a worker of its own (or a draft engine in this
process), or the n-gram draft (orchestrator/proposers/ngram.py), which answers the same calls.

The round's Propose starts where the draft's session holds the request's tokens validly
(draft_synced) and brings the tokens after it; the worker truncates its session there, takes them
in and proposes up to gamma tokens, each x_i ~ q_i (specdec/wire.py, Proposal). After the round
the draft's session is valid up to what the target validated: its cache of the accepted drafts
is what it computed for them, whoever proposed the rest.
"""

from __future__ import annotations

from dataclasses import replace

from specdec.wire import Proposal, ProposeCall, Verification


class DraftWorkerProposer:
    """Stateless: one serves every request drafted by a model or the n-gram draft."""

    def call(self, req, rnd, seed: int) -> ProposeCall:
        """The round's Propose (seed: the request's draft seed, RequestState.draft_seed)."""
        options = req.draft_options
        ahead = req.ahead(rnd.gamma)
        if ahead != options.ahead:
            options = replace(options, ahead=ahead)
        return ProposeCall(req.placement.session_id, req.draft_synced, req.tokens[req.draft_synced:], rnd.gamma,
                           req.params, seed, options, self.features(req))

    def features(self, req):
        return None

    def take(self, req, rnd, proposals: list[Proposal]) -> None:
        """x_i and q_i from the draft's answer; gamma becomes the drafts made (a draft may stop early)."""
        for p in proposals:
            rnd.drafts.append(p.token_id)
            rnd.draft_probs.append(p.probs)
            if p.batch_rows:  # only the last proposal reports them
                rnd.draft_rows, rnd.draft_pass_s = p.batch_rows, p.pass_s
            req.stats.wire_bytes += p.wire_bytes
            req.stats.draft_compute_s += p.compute_s
        rnd.gamma = len(rnd.drafts)  # fewer when the draft stopped early (or a lookup found nothing)

    def synced_after(self, req) -> int:
        """The draft session's valid length after a round it drafted (the target's, committed)."""
        return req.target_synced

    def verified(self, req, verification: Verification) -> None:
        """What the target's verdict leaves the draft: nothing (a model reads only tokens)."""

    def target_moved(self, req) -> None:
        """The request's target session moved (failover): nothing of it concerns a model draft."""
