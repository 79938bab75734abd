"""gRPC servicer of the draft worker: proto to engine calls and back."""

from __future__ import annotations

from specdec.protocol import SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.wire import DraftOptions, Features, Proposal, ProposeCall, call_status
from specdec.worker.server import SessionRpcs


def propose_call(request: draft_pb2.ProposeRequest) -> ProposeCall:
    return ProposeCall(request.session_id, request.start, list(request.token_ids), request.gamma,
                       SamplingParams.from_proto(request.sampling), request.seed,
                       DraftOptions.from_proto(request.options), Features.from_proto(request.features))


def proposal_to_proto(p: Proposal) -> draft_pb2.Proposal:
    return draft_pb2.Proposal(index=p.index, token_id=p.token_id,
                              probs=p.probs.to_proto() if p.probs is not None else None,
                              compute_s=p.compute_s, batch_rows=p.batch_rows, pass_s=p.pass_s)


class DraftServicer(SessionRpcs, draft_pb2_grpc.DraftWorkerServicer):
    def Propose(self, request, context):
        engine = self.authorized(request, context)  # first: an unknown session is NOT_FOUND, whatever else is wrong
        c = propose_call(request)
        for p in engine.propose(c.session_id, c.start, c.token_ids, c.gamma, c.params, c.seed, c.options,
                                c.features):
            yield proposal_to_proto(p)

    def ProposeBatch(self, request, context):
        results = self.run_batch(request.calls, context, propose_call, lambda engine, calls: engine.propose_batch(calls))
        return draft_pb2.ProposeBatchResponse(results=[
            draft_pb2.ProposeResult(status=call_status(r)) if isinstance(r, BaseException) else
            draft_pb2.ProposeResult(proposals=[proposal_to_proto(p) for p in r], status=call_status(None))
            for r in results])
