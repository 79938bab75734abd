"""The draft role: what specdec/worker/server.py needs to run a draft worker."""

from draft_service.engine import DraftEngine
from draft_service.servicer import DraftServicer
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.worker.config import DEFAULT_PORTS
from specdec.worker.server import WorkerRole

DRAFT = WorkerRole("draft", DEFAULT_PORTS["draft"], DraftEngine, DraftServicer, draft_pb2_grpc.add_DraftWorkerServicer_to_server,
                   draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name)
