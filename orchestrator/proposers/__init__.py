"""Where a round's drafts come from: one file per source, behind one interface (vLLM's
v1/spec_decode/ keeps one file per proposer the same way).

  draft_model.py  a draft worker's proposals (DraftWorkerProposer): a small model on a worker of
                  its own (or an engine in this process), or the n-gram draft of ngram.py
  eagle.py        a draft worker serving an EAGLE-3 feature head (FeatureHeadProposer): the same
                  calls, fed the target's features, and synced only to the round's start
  ngram.py        the n-gram draft with no model (`--draft ngram`): a draft worker in this process
  suffix.py       suffix drafts: what followed the same tokens before, in this request or an earlier
                  one; no worker and no draft pass (the step loop adds them to steps that draft
                  nothing else: orchestrator/steps.py, _suffix_drafts)

A request's worker-backed proposer (proposer_for) makes the round's Propose (`call`), takes its
answer into the round (`take`), says how far the draft's session is valid after the round
(`synced_after`), keeps what it needs of the target's verdict (`verified`) and of a new target's
prefill (`target_moved`). orchestrator/rounds.py calls these; nothing else knows which source
drafted.
"""

from __future__ import annotations

from orchestrator.proposers.draft_model import DraftWorkerProposer
from orchestrator.proposers.eagle import FeatureHeadProposer


def proposer_for(placement) -> DraftWorkerProposer:
    """The proposer of a request placed so: a feature head's where its draft is one (its features
    so far: the target prefill's), else a draft worker's."""
    if placement.draft is not None and placement.feature_layers:
        return FeatureHeadProposer(placement.opened_features)
    return DraftWorkerProposer()
