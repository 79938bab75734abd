"""gRPC servicer of the draft worker: proto to engine calls and back."""

from __future__ import annotations

from specdec.protocol import DraftOptions, SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.worker.server import SessionRpcs


class DraftServicer(SessionRpcs, draft_pb2_grpc.DraftWorkerServicer):
    def Propose(self, request, context):
        proposals = self.authorized(request, context).propose(
            request.session_id,
            request.start,
            list(request.token_ids),
            request.gamma,
            SamplingParams.from_proto(request.sampling),
            request.seed,
            DraftOptions.from_proto(request.options),
        )
        for p in proposals:
            yield draft_pb2.Proposal(
                index=p.index,
                token_id=p.token_id,
                probs=p.probs.to_proto() if p.probs is not None else None,
                compute_s=p.compute_s,
                batch_rows=p.batch_rows,
                pass_s=p.pass_s,
            )
