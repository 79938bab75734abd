"""A target worker whose greedy verifications keep drafts by a coin: benchmarks only, not exact.

`python -m specdec_tools.synthetic_target --synthetic-acceptance A <target worker flags>`.
Random-weight models (a GPU machine with no real weights) never agree with each other, so their
rounds keep no draft; this target keeps each draft with probability A whatever its model chose,
then gives its model's token at the first draft not kept (or the bonus position). Rounds then
take the shape of a model pair with that acceptance (a geometric number of kept drafts), as
llama.cpp's --spec-synth-len does, while every pass, call and byte is the real one.

It lives with the benchmarks, not in the service: `specdec bench serve --synthetic-acceptance`
starts it in place of `python -m target_service` (specdec_tools/stack.py), with the
orchestrator's suffix drafts off (their tokens would be kept by the coin too).

Only greedy calls (and coupled ones: those whose answer is the chosen token at every position)
are changed; the coin of a call is seeded by what it verifies, so a benchmark's requests differ
and each is reproducible. Where the model's own token at the first draft not kept equals that
draft (about one in the vocabulary's size with random weights), the orchestrator keeps it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Sequence


def synthetic_choices(draft_token_ids: Sequence[int], target_argmax: Sequence[int], acceptance: float,
                      coin: random.Random) -> list[int]:
    """The target's choices as the coin makes them: the drafts kept (each w.p. `acceptance`,
    until the first not kept), then the target's own choices.

    draft_token_ids: [gamma]
    target_argmax:   [gamma + 1]
    """
    gamma = len(draft_token_ids)
    assert len(target_argmax) == gamma + 1 and 0.0 <= acceptance < 1.0, (gamma, len(target_argmax), acceptance)
    kept = 0
    while kept < gamma and coin.random() < acceptance:
        kept += 1
    return [*draft_token_ids[:kept], *target_argmax[kept:]]


def synthetic_engine(acceptance: float) -> type:
    """A TargetEngine whose greedy Verify answers keep drafts by a coin (synthetic_choices)."""
    from target_service.engine import TargetEngine

    class SyntheticTargetEngine(TargetEngine):
        def _verify(self, call):
            verification = yield from super()._verify(call)
            if verification.argmax is None or not call.draft_token_ids:
                return verification
            coin = random.Random(hash((call.start, tuple(call.token_ids), tuple(call.draft_token_ids))))
            return dataclasses.replace(verification, argmax=synthetic_choices(
                call.draft_token_ids, verification.argmax, acceptance, coin))

    return SyntheticTargetEngine


def parse_acceptance(argv: list[str] | None) -> tuple[float, list[str]]:
    """--synthetic-acceptance A (in [0, 1)) and the target worker's own flags."""
    p = argparse.ArgumentParser(prog="python -m specdec_tools.synthetic_target", add_help=False)
    p.add_argument("--synthetic-acceptance", type=float, required=True)
    a, rest = p.parse_known_args(argv)
    if not 0.0 <= a.synthetic_acceptance < 1.0:
        p.error(f"--synthetic-acceptance must lie in [0, 1), got {a.synthetic_acceptance}")
    return a.synthetic_acceptance, rest


def main(argv: list[str] | None = None) -> None:
    import logging

    from specdec.worker.server import main as serve
    from target_service.role import TARGET

    acceptance, rest = parse_acceptance(argv)
    logging.getLogger(__name__).warning("synthetic acceptance %.3f: greedy output is NOT the target's "
                                        "(benchmarks only)", acceptance)
    serve(dataclasses.replace(TARGET, engine_class=synthetic_engine(acceptance)), rest)


if __name__ == "__main__":
    from specdec.threads import bound_openmp_spinning

    bound_openmp_spinning()  # before torch is imported, as python -m target_service does
    main()
