"""gRPC servicer of the target worker: proto to engine calls and back."""

from __future__ import annotations

from specdec.protocol import SamplingParams
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.wire import Verification, VerifyCall, call_status
from specdec.worker.server import SessionRpcs


def verify_call(request: target_pb2.VerifyRequest) -> VerifyCall:
    return VerifyCall(request.session_id, request.start, list(request.token_ids), list(request.draft_token_ids),
                      SamplingParams.from_proto(request.sampling), request.top_logprobs if request.logprobs else None)


def verification_to_proto(v: Verification) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        argmax_token_ids=v.argmax or [],
        probs=[p.to_proto() for p in v.probs or []],
        length=v.length,
        compute_s=v.compute_s,
        batch_rows=v.batch_rows,
        pass_s=v.pass_s,
        logprob_bases=v.logprob_bases or [],
        top_logprobs=[target_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in v.top_logprobs or ()],
        raw_log_norms=v.raw_log_norms or [],
        features=v.features.to_proto() if v.features is not None else None,
    )


class TargetServicer(SessionRpcs, target_pb2_grpc.TargetWorkerServicer):
    def Verify(self, request, context):
        engine = self.authorized(request, context)  # first: an unknown session is NOT_FOUND, whatever else is wrong
        c = verify_call(request)
        return verification_to_proto(engine.verify(c.session_id, c.start, c.token_ids, c.draft_token_ids, c.params,
                                                   c.top_logprobs))

    def VerifyBatch(self, request, context):
        results = self.run_batch(request.calls, context, verify_call, lambda engine, calls: engine.verify_batch(calls))
        return target_pb2.VerifyBatchResponse(results=[
            target_pb2.VerifyResult(status=call_status(r)) if isinstance(r, BaseException) else
            target_pb2.VerifyResult(response=verification_to_proto(r), status=call_status(None))
            for r in results])
