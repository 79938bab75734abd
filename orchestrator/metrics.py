"""The orchestrator's metrics: what a request and each of its rounds add to the instruments.

They are fed the same numbers that go into the GenerationStats returned to the client, so the
two agree by construction (tests/orchestrator/test_telemetry.py checks that they do).
Names follow the GenAI semantic conventions where one exists (gen_ai.server.*), specdec.*
otherwise; Prometheus shows them with dots as underscores and a unit suffix.
"""

from __future__ import annotations

from specdec import telemetry as t

ACCEPTED_LENGTH_BUCKETS = tuple(range(0, 17))  # 0..MAX_GAMMA accepted drafts in a round


class DecodingMetrics:
    def __init__(self, meter):
        self.requests = meter.create_counter(
            "specdec.requests", unit="{request}", description="Requests finished, by gRPC status code")
        self.drafted = meter.create_counter(
            "specdec.drafted_tokens", unit="{token}", description="Draft tokens proposed, by draft position")
        self.accepted = meter.create_counter(
            "specdec.accepted_tokens", unit="{token}", description="Draft tokens accepted, by draft position")
        self.rounds = meter.create_counter("specdec.rounds", unit="{round}", description="Speculative rounds")
        self.wire_bytes = meter.create_counter(
            "specdec.wire_bytes", unit="By", description="Bytes moved between the orchestrator and its workers")
        self.accepted_length = meter.create_histogram(
            "specdec.round.accepted_length", unit="{token}", description="Drafts accepted in one round",
            explicit_bucket_boundaries_advisory=ACCEPTED_LENGTH_BUCKETS)
        self.gamma = meter.create_histogram(
            "specdec.round.gamma", unit="{token}", description="Drafts a round made (0: a round without drafts)",
            explicit_bucket_boundaries_advisory=ACCEPTED_LENGTH_BUCKETS)
        self.stage = meter.create_histogram(
            "specdec.stage.duration", unit="s", description="Time per stage: prefill, draft, verify, sampling",
            explicit_bucket_boundaries_advisory=t.SECONDS_BUCKETS)
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Request start to first output token",
            explicit_bucket_boundaries_advisory=t.SECONDS_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s", description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=t.SECONDS_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", description="Whole request",
            explicit_bucket_boundaries_advisory=t.SECONDS_BUCKETS)
        self.tokens = meter.create_counter(
            "gen_ai.server.token.usage", unit="{token}", description="Input and output tokens")
        self.step_seconds = meter.create_counter(
            "specdec.step.duration", unit="s",
            description="Seconds of step-loop steps, by arm (draft, plain) and whether the step explored")
        self.ahead = meter.create_counter(
            "specdec.draft.ahead_rounds", unit="{round}",
            description="Rounds whose drafts were asked for ahead (while the target verified the round before), by "
                        "outcome: hit (all made by then: no draft time in the round), miss (drafted on the spot)")
        self.regret = meter.create_counter(
            "specdec.policy.regret", unit="s",
            description="Seconds lost in steps of the arm that measured worse (draft or plain) at their load")

    def record_round(self, gamma: int, num_accepted: int, draft_s: float, verify_s: float, sampling_s: float,
                     wire_bytes: int) -> None:
        self.rounds.add(1)
        self.gamma.record(gamma)
        for i in range(gamma):
            self.drafted.add(1, {t.POSITION: i})
        for i in range(num_accepted):
            self.accepted.add(1, {t.POSITION: i})
        if gamma > 0:
            self.accepted_length.record(num_accepted)
            self.stage.record(draft_s, {t.STAGE: "draft"})
        self.stage.record(verify_s, {t.STAGE: "verify"})
        self.stage.record(sampling_s, {t.STAGE: "sampling"})
        self.wire_bytes.add(wire_bytes)

    def record_ahead(self, hit: bool) -> None:
        self.ahead.add(1, {t.OUTCOME: "hit" if hit else "miss"})

    def record_step(self, arm: str, explored: bool, seconds: float, regret_s: float) -> None:
        self.step_seconds.add(seconds, {t.ARM: arm, t.EXPLORED: explored})
        if regret_s > 0:
            self.regret.add(regret_s, {t.ARM: arm})

    def record_prefill(self, seconds: float) -> None:
        self.stage.record(seconds, {t.STAGE: "prefill"})

    def record_first_token(self, seconds: float) -> None:
        self.ttft.record(seconds)

    def record_finished(self, stats, first_token_s: float | None, request_s: float) -> None:
        """first_token_s and request_s: from the request's arrival, on one clock (stats.total_s starts
        later, at its prefill, so it cannot be set against first_token_s)."""
        self.duration.record(request_s)
        self.requests.add(1, {t.STATUS: 0})
        self.tokens.add(stats.prompt_tokens, {t.GEN_AI_TOKEN_TYPE: "input"})
        self.tokens.add(stats.generated_tokens, {t.GEN_AI_TOKEN_TYPE: "output"})
        if first_token_s is not None and stats.generated_tokens > 1:
            self.tpot.record((request_s - first_token_s) / (stats.generated_tokens - 1))

    def record_failed(self, code_value: int) -> None:
        self.requests.add(1, {t.STATUS: code_value})
