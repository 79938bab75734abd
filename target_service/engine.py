"""Scores a round's drafts with one forward pass of the target model.

The pass runs over the tokens the target has not cached yet (the previous round's recovered or
bonus token, or the prompt's last token) followed by the gamma drafts, and keeps logits for the
last gamma + 1 positions only: position i predicts draft i, the last is the bonus position.
"""

from __future__ import annotations

import math
import time

import torch

from specdec.errors import InvalidArgument, ServiceError
from specdec.protocol import MAX_GAMMA, MAX_TOP_LOGPROBS, SamplingParams
from specdec.sampling import apply_controls, coupled_choice, process_logits
from specdec.wire import Verification, VerifyCall
from specdec.worker.engine import WorkerEngine
from specdec.worker.runner import Program
from specdec.worker.sessions import take_features


class TargetEngine(WorkerEngine):
    def verify(
        self,
        session_id: str,
        start: int,
        token_ids: list[int],
        draft_token_ids: list[int],
        params: SamplingParams,
        top_logprobs: int | None = None,
    ) -> Verification:
        """top_logprobs: None, or also the model's log-probabilities at every position and that
        many most likely tokens with theirs (Verification.logprob_bases, .top_logprobs)."""
        return self.drive(self._verify(VerifyCall(session_id, start, token_ids, draft_token_ids, params, top_logprobs)))

    def verify_batch(self, calls: list[VerifyCall]) -> list[Verification | ServiceError]:
        """The verifications of many sessions' calls (one orchestrator step), scored in one forward
        pass. Per call, its Verification or the error it raised."""
        return self.run_calls(calls, self._verify)

    def _verify(self, call: VerifyCall) -> Program:
        """A Verify's program (WorkerEngine.run_calls): its one pass."""
        session_id, start, token_ids, draft_token_ids = call.session_id, call.start, call.token_ids, call.draft_token_ids
        params, top_logprobs = call.params, call.top_logprobs
        if len(draft_token_ids) > MAX_GAMMA:
            raise InvalidArgument(f"at most {MAX_GAMMA} drafts per round, got {len(draft_token_ids)}")
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        params.validate().check_vocabulary(self.vocab_size)
        session = self.session(session_id)
        with session.lock:
            t0 = time.perf_counter()
            session.check_start(start, len(token_ids))
            self.check_tokens([*token_ids, *draft_token_ids], already=start)
            self.grow(session, start + len(token_ids) + len(draft_token_ids))
            self.truncate_to(session, start)
            session.tokens.extend(token_ids)
            session.uncache_last()
            session.tokens.extend(draft_token_ids)
            first = len(session.tokens) - len(draft_token_ids)  # the position the pass's first row predicts
            grammar = self.grammar_at(session, params, first)
            argmax, probs, bases, top, norms = yield self.work(
                session, len(draft_token_ids) + 1, "verify",
                lambda logits: self._score(logits, params, top_logprobs, first, session.tokens, grammar))
            return Verification(argmax, probs, len(session.tokens), time.perf_counter() - t0,
                                session.last_pass_rows, session.last_pass_s, logprob_bases=bases, top_logprobs=top,
                                raw_log_norms=norms, features=take_features(session))

    def _score(self, logits, params: SamplingParams, top_logprobs: int | None, first: int, tokens: list[int],
               grammar=None):
        """logits: [gamma + 1, vocab], row i predicting position first + i, whose prefix is
        tokens[:first + i] (the session's tokens, drafts included) -> (tokens, None) when the
        target decides (greedy: the argmax; coupled: the seeded Gumbel-max choice), else (None, p
        per position), both after the request's decoding controls (grammar: its matcher at position
        first, for structured output); then, asked for logprobs,
        (bases, top, raw_log_norms) of Verification, else Nones."""
        raw = logits
        if params.controlled:  # a copy only when the raw logits are still wanted (logprobs)
            logits = apply_controls(logits.float() if top_logprobs is None else logits.float().clone(), params,
                                    tokens, first, grammar)
        if grammar is not None:
            _check_satisfiable(logits, params, tokens, first)
        dists = None  # the processed distributions (sampling): p per position
        if params.coupled:
            dists = [process_logits(row, params, self.vocab_size) for row in logits]
            chosen = [coupled_choice(d, params.coupling_seed, first + i) for i, d in enumerate(dists)]
            choice, probs = torch.tensor(chosen, device=logits.device), None
        else:
            choice = logits.argmax(dim=-1) if params.greedy or top_logprobs is not None else None
            probs = dists = None if params.greedy else [process_logits(row, params, self.vocab_size) for row in logits]
        bases = top = norms = None
        if top_logprobs is not None and params.processed_logprobs:
            bases, top = _processed_logprobs(logits, dists, choice, top_logprobs)
        elif top_logprobs is not None:
            logprobs = torch.log_softmax(raw.float(), dim=-1)  # [gamma + 1, vocab]: the raw model's
            if params.deterministic:  # the only token the round can emit at each position: its raw log-probability
                bases = logprobs.gather(-1, choice[:, None])[:, 0].tolist()
            elif not params.controlled:
                # p(t) = exp(l_t / T) / S over p's support, so log P(t) = T log p(t) + c; the argmax fixes c
                at_choice = logprobs.gather(-1, choice[:, None])[:, 0].tolist()
                bases = [lp - params.temperature * math.log(p.prob_of(a))
                         for lp, p, a in zip(at_choice, probs, choice.tolist())]
            else:
                # the controlled logit of t is T log p(t) + base + norm (the argmax fixes base); the
                # orchestrator undoes the controls on it and subtracts norm (Verification.logprob)
                norms = torch.logsumexp(raw.float(), dim=-1).tolist()
                at_choice = logits.gather(-1, choice[:, None])[:, 0].tolist()
                bases = [c - n - params.temperature * math.log(p.prob_of(a))
                         for c, n, p, a in zip(at_choice, norms, probs, choice.tolist())]
            if top_logprobs:
                # [gamma + 1, top_logprobs]; a vocabulary smaller than asked gives all it has
                values, indices = logprobs.topk(min(top_logprobs, logprobs.shape[-1]), dim=-1)
                top = list(zip(indices.tolist(), values.tolist()))
        return (choice.tolist() if params.deterministic else None), probs, bases, top, norms


def _check_satisfiable(logits: torch.Tensor, params: SamplingParams, tokens: list[int], first: int) -> None:
    """UnsatisfiableGrammar (INVALID_ARGUMENT) where the grammar leaves no token at a position the
    round reaches: the first, or (greedy and coupled rounds) one after drafts the target takes."""
    dead = (~torch.isfinite(logits).any(dim=-1)).tolist()
    if not any(dead):
        return
    reach = 1
    if params.greedy:  # the rows after drafts equal to the argmax before them are reached too
        choice = logits.argmax(dim=-1).tolist()
        while reach < len(dead) and choice[reach - 1] == tokens[first + reach - 1]:
            reach += 1
    else:  # sampled or coupled: any row may be reached
        reach = len(dead)
    if any(dead[:reach]):
        from specdec.grammar import UnsatisfiableGrammar

        at = first + dead.index(True) - params.output_start
        raise UnsatisfiableGrammar(f"the structured output cannot be produced with this model's tokens: after "
                                   f"{at} generated tokens the grammar allows none of them (a layout that needs a "
                                   f"character no token spells?)")


def _processed_logprobs(logits, dists, choice, k: int):
    """logprobs_mode "processed": the log-probabilities of the distribution each position's token
    is chosen from: greedy, the log-softmax of the controlled logits; sampling, log p (after
    temperature, min_p, top-k, top-p; -inf off its support). -> (each position's chosen token's,
    the k most likely per position, or None)."""
    if dists is None:  # greedy
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    else:
        logprobs = torch.stack([d.dense() for d in dists]).log()
    bases = logprobs.gather(-1, choice[:, None])[:, 0].tolist()
    if not k:
        return bases, None
    values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return bases, list(zip(indices.tolist(), values.tolist()))
