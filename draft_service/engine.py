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
from specdec import ngram
from specdec.protocol import MAX_GAMMA, CompactProbs, DraftOptions, Proposal, SamplingParams
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
        options: DraftOptions = DraftOptions(),
    ) -> Iterator[Proposal]:
        """Truncates to `start`, appends token_ids, then yields up to gamma proposals as they come.

        The session lock is held for each pass, never across a yield (the caller may take its time
        reading a proposal); a call that changes the session in between aborts this one.

        With options.lookup, the first pass also runs the tokens that followed the sequence's last
        n-gram where it occurred before (specdec/ngram.py), so that one pass yields the draft's
        distribution at every guessed position: proposal i is drawn from q_i as always, and while
        it equals the guess, q_{i+1} is already computed. The proposals are those of plain
        drafting; only fewer passes make them.

        With options.p_min, the call stops after a proposal the draft gave less than p_min (once
        min_drafts are made). Both depend on the draft's side alone (its tokens, its q, its own
        draws), never on the target: whatever the draft proposes, each proposal is a draw from the
        q sent with it, and the rejection test keeps the output exactly the target's."""
        if not 1 <= gamma <= MAX_GAMMA:
            raise InvalidArgument(f"gamma must lie in [1, {MAX_GAMMA}] for a proposal, got {gamma}")
        params.validate()
        options.validate()
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
        made, rows, seconds = 0, 0, 0.0  # proposals; rows and seconds of the passes, summed
        while made < gamma:
            t0 = time.perf_counter()
            with session.lock:
                if session.version != version:
                    raise Aborted(f"session {session_id} was changed by another call during this Propose")
                guess = ngram.lookup(session.tokens, gamma - made - 1, options.lookup) if options.lookup else []
                base = len(session.tokens)
                session.tokens.extend(guess)
                picks = self.run(session, len(guess) + 1, "propose",
                                 lambda logits: self._picks(logits, guess, params, generator, options, made))
                # the tokens are the prefix, the guesses the draft took, and its last proposal,
                # which stays uncached until the next pass; the cache holds no guess it refused
                if guess:
                    session.truncate(base + len(picks) - 1)
                    version = session.version
                session.tokens.append(picks[-1][0])
                rows += session.last_pass_rows
                seconds += session.last_pass_s
            elapsed = (time.perf_counter() - t0) / len(picks)
            for j, (token, probs, stop) in enumerate(picks):
                made += 1
                last = made == gamma or stop
                # the last proposal reports the passes' rows and seconds per proposal (what one
                # draft cost): the gamma policy fits them
                yield Proposal(made - 1, token, probs, elapsed, max(1, round(rows / made)) if last else 0,
                               seconds / made if last else 0.0)
                if last:
                    return

    def _picks(self, logits: torch.Tensor, guess: list[int], params: SamplingParams, generator: torch.Generator,
               options: DraftOptions, made: int) -> list[tuple[int, CompactProbs | None, bool]]:
        """logits: [len(guess) + 1, vocab] -> [(proposal, q, stop)], one per row while the
        proposals equal the guesses, ending at the first that does not, or at a stop."""
        picks = []
        for j in range(logits.shape[0]):
            row = logits[j]
            if params.greedy:
                token, probs = int(row.argmax()), None
                confidence = float(torch.softmax(row, -1)[token]) if options.p_min > 0 else 1.0
            else:
                probs = process_logits(row, params, self.vocab_size)
                token = probs.sample(generator)
                confidence = probs.prob_of(token)
            stop = confidence < options.p_min and made + j + 1 >= options.min_drafts
            picks.append((token, probs, stop))
            if stop or j == len(guess) or token != guess[j]:
                return picks
        return picks
