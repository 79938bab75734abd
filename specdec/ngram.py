"""Prompt lookup: guess what comes next by finding the sequence's latest n-gram earlier in it.

Code edits, refactors and answers that quote their prompt repeat long runs of tokens; where the
last n tokens of the sequence occurred before, the tokens that followed them then are a good
guess for what follows now (transformers' `prompt_lookup_num_tokens`, llama.cpp's n-gram
drafts). No model runs: a lookup costs microseconds.

Two users: orchestrator/proposers/ngram.py proposes the guesses as drafts (a model-free draft, q a point
mass), and draft_service/engine.py has its model check them in one pass instead of one pass per
draft.
"""

from __future__ import annotations

from typing import Sequence

MIN_NGRAM = 2  # a single repeated token (a bracket, a newline) predicts little
MAX_NGRAM = 4


def lookup(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
           window: int = 4096) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    for the longest n in [min_ngram, max_ngram] that occurred; [] when none did. Searches the
    last `window` tokens only (a long context must not make every round slower)."""
    end = len(tokens)
    if k <= 0 or end <= min_ngram:
        return []
    seq = list(tokens[max(0, end - window):])
    n_max = min(max_ngram, len(seq) - 1)
    last = seq[-1]
    # positions (latest first) where the last token occurred before, as candidates' ends
    ends = [i for i in range(len(seq) - 2, -1, -1) if seq[i] == last]
    for n in range(n_max, min_ngram - 1, -1):
        tail = seq[-n:]
        for i in ends:
            if i >= n - 1 and seq[i - n + 1 : i + 1] == tail:
                return list(seq[i + 1 : i + 1 + k])
    return []
