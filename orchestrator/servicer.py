"""gRPC servicer of the orchestrator: proto to GenerationRequest, the loop's chunks back to proto."""

from __future__ import annotations

import re
from dataclasses import replace

from orchestrator.admission import Admission, CallDeadline, client_key
from orchestrator.decoder import SpeculativeDecoder, collect_choices
from orchestrator.pool import parse_entries
from specdec.errors import Cancelled, FailedPrecondition, InvalidArgument, PermissionDenied, ServiceError, Unavailable
from specdec.security import TokenSet, bearer_token
from specdec.protocol import GenerationRequest, choice_of, chunk_to_proto, request_from_proto, result_to_proto
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

class DecoderSlot:
    """Holds the decoder once both workers answer and are paired; until then, UNAVAILABLE naming
    the workers waited for and what each is doing."""

    def __init__(self, decoder: SpeculativeDecoder | None = None):
        self.decoder = decoder
        self.pools: tuple = (None, None)  # (targets, drafts), set by the server
        self.error: ServiceError | None = None  # a permanent refusal, e.g. a mismatched pair
        self.waiting_on = None  # the pool start-up waits for now (orchestrator/server.py connect)
        self.without_drafts = ""  # why it serves without the drafts it was given (their load failed)

    def get(self) -> SpeculativeDecoder:
        if self.decoder is not None:
            return self.decoder
        if self.error is not None:
            raise self.error
        waiting_for = self.waiting_on.progress() if self.waiting_on is not None else "the workers"
        raise Unavailable(f"orchestrator is starting: waiting for {waiting_for}")

    def status(self) -> str:
        """Why it is not serving, or what it serves without; "" when all is well."""
        try:
            self.get()
        except ServiceError as exc:
            return exc.message
        return f"serving without drafts: {self.without_drafts}" if self.without_drafts else ""


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, slot: DecoderSlot, admission: Admission, admins: TokenSet = TokenSet(frozenset()),
                 request_timeout_s: float = 0.0):
        self.slot = slot
        self.request_timeout_s = request_timeout_s
        self.admission = admission  # running requests, and the queue of those waiting for a turn
        # --admin-token-file: adding workers, and seeing where they are, is for admins only
        # (a fake worker added by any client would receive prompts and write the answers)
        self.admins = admins

    def _client(self, context) -> str:
        return client_key(bearer_token(context.invocation_metadata()), context.peer())

    @staticmethod
    def _request(request, context) -> GenerationRequest:
        """The request, its prefix-cache scope that of the caller's bearer token ('' without one)."""
        token = bearer_token(context.invocation_metadata())
        return replace(request_from_proto(request), cache_scope=client_key(token, "") if token else "")

    def Generate(self, request, context):
        decoder = self.slot.get()
        deadline = CallDeadline(context, self.request_timeout_s)

        def between(chunk) -> None:
            if not context.is_active():  # the client left: stop within one round
                raise Cancelled("the client cancelled the request")
            if chunk.finish_reason is None:
                deadline.check()

        with self.admission.slot(deadline, self._client(context)):
            choices = collect_choices(decoder.generate_stream(self._request(request, context)), between)
        answers = [result_to_proto(c.text, c.token_ids, c.last, c.logprobs) for c in choices]
        response = answers[0]
        if len(answers) > 1:
            response.choices.extend(choice_of(i, a) for i, a in enumerate(answers))
        return response

    def GenerateStream(self, request, context):
        decoder = self.slot.get()
        deadline = CallDeadline(context, self.request_timeout_s)
        with self.admission.slot(deadline, self._client(context)):
            # a cancelled stream closes this generator, whose finally closes the sessions
            stream = decoder.generate_stream(self._request(request, context))
            try:
                for chunk in stream:
                    yield chunk_to_proto(chunk)
                    if chunk.finish_reason is None:
                        deadline.check()
            finally:
                stream.close()

    def ListWorkers(self, request, context):
        return self._workers(addresses=self.admins.caller_holds_one(context))

    def AddWorkers(self, request, context):
        if not self.admins:
            raise PermissionDenied("AddWorkers is off: start the orchestrator with --admin-token-file to allow it")
        if not self.admins.caller_holds_one(context):
            raise PermissionDenied("AddWorkers needs an admin token (--admin-token-file)")
        targets, drafts = self.slot.pools
        try:
            entries = parse_entries(request.target), parse_entries(request.draft)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if entries[1] and drafts is None:
            raise FailedPrecondition("this orchestrator runs without drafts (no --draft); it cannot add one")
        if entries[1] and self.slot.without_drafts:  # its decoder holds no draft pool to add to
            raise FailedPrecondition(f"this orchestrator serves without drafts ({self.slot.without_drafts}); "
                                     "restart it to draft")
        targets.add(entries[0])
        if entries[1]:
            drafts.add(entries[1])
        return self._workers(addresses=True)

    def _workers(self, addresses: bool) -> orchestrator_pb2.ListWorkersResponse:
        """addresses: where each worker is (False for callers without an admin token)."""
        statuses = []
        for pool in self.slot.pools:
            for m in pool.members() if pool is not None else ():
                statuses.append(orchestrator_pb2.WorkerStatus(
                    role=pool.role, address=m.address if addresses else "", source=m.entry if addresses else "",
                    state=m.state, message=m.message if addresses else without_addresses(m.message),
                    model_name=m.info.model_name if m.info else "", open_sessions=m.info.open_sessions if m.info else 0,
                    active_sessions=m.active, placed_sessions=m.placed))
        return orchestrator_pb2.ListWorkersResponse(workers=statuses)


def without_addresses(message: str) -> str:
    """A worker's state message for callers who may not see where workers are."""
    return re.sub(r"\b[\w.-]+:\d+\b", "<address>", message)
