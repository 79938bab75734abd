"""gRPC servicer of the target worker: proto to engine calls and back."""

from __future__ import annotations

from specdec.protocol import SamplingParams
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.worker.server import SessionRpcs


class TargetServicer(SessionRpcs, target_pb2_grpc.TargetWorkerServicer):
    def Verify(self, request, context):
        v = self.authorized(request, context).verify(
            request.session_id,
            request.start,
            list(request.token_ids),
            list(request.draft_token_ids),
            SamplingParams.from_proto(request.sampling),
            request.top_logprobs if request.logprobs else None,
        )
        return target_pb2.VerifyResponse(
            argmax_token_ids=v.argmax or [],
            probs=[p.to_proto() for p in v.probs or []],
            length=v.length,
            compute_s=v.compute_s,
            batch_rows=v.batch_rows,
            pass_s=v.pass_s,
            logprob_bases=v.logprob_bases or [],
            top_logprobs=[target_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in v.top_logprobs or ()],
        )
