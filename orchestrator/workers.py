"""The interface the speculative loop drives: a draft worker and a target worker.

Two implementations satisfy it: the engines themselves (draft_service.engine.DraftEngine and
target_service.engine.TargetEngine, in-process) and the gRPC clients in orchestrator.remote.
The loop cannot tell them apart, which is how benchmarks measure what the network split costs.
"""

from __future__ import annotations

from typing import Protocol

from specdec.errors import FailedPrecondition, ServiceError
from specdec.protocol import SamplingParams
from specdec.wire import ANY_VOCABULARY, Features, ModelInfo, Proposal, ProposeCall, Verification, VerifyCall


class Worker(Protocol):
    def describe(self) -> ModelInfo: ...

    def open_session(self, session_id: str, token_ids: list[int], scope: str = "", *,
                     feature_layers: tuple[int, ...] = ()) -> tuple[int, float, int]: ...

    def fork_session(self, session_id: str, parent_id: str, token_ids: list[int]) -> tuple[int, float, int]: ...

    def truncate(self, session_id: str, length: int) -> int: ...

    def close_session(self, session_id: str) -> None: ...


class DraftWorker(Worker, Protocol):
    def propose_batch(self, calls: list[ProposeCall]) -> list[list[Proposal] | ServiceError]:
        """One step's Propose calls: per call, its proposals or its error."""


class TargetWorker(Worker, Protocol):
    def opened_features(self, session_id: str) -> Features | None: ...

    def verify(
        self, session_id: str, start: int, token_ids: list[int], draft_token_ids: list[int], params: SamplingParams,
        top_logprobs: int | None = None,
    ) -> Verification:
        """One call alone (a step's Verify moved to another target by a failover)."""

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verification | ServiceError]:
        """One step's Verify calls, in one pass: per call, its Verification or its error."""

    def tokenizer_files(self) -> dict[str, bytes]: ...


def check_pair(target: ModelInfo, draft: ModelInfo) -> None:
    """Refuses a draft whose vocabulary differs from the target's: its acceptance would collapse.
    A model-free draft (orchestrator/proposers/ngram.py) proposes tokens of the sequence: any vocabulary."""
    if draft.vocab_fingerprint == ANY_VOCABULARY:
        return
    if draft.feature_layers:  # a feature head reads the target's hidden states: they must be what it was made for
        if not target.num_layers or any(i >= target.num_layers for i in draft.feature_layers) \
                or draft.feature_size != len(draft.feature_layers) * target.hidden_size:
            raise FailedPrecondition(
                f"feature head '{draft.model_name}' reads layers {list(draft.feature_layers)} ({draft.feature_size} "
                f"values a position) but target model '{target.model_name}' has {target.num_layers} layers of width "
                f"{target.hidden_size}: the head was made for another target")
    if target.vocab_size != draft.vocab_size or target.vocab_fingerprint != draft.vocab_fingerprint:
        raise FailedPrecondition(
            f"draft model '{draft.model_name}' (vocabulary {draft.vocab_size}, fingerprint {draft.vocab_fingerprint[:12]}) "
            f"cannot draft for target model '{target.model_name}' (vocabulary {target.vocab_size}, "
            f"fingerprint {target.vocab_fingerprint[:12]}): their vocabularies differ"
        )
