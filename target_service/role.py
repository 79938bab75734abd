"""The target role: what specdec/worker/server.py needs to run a target worker."""

from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.worker.config import DEFAULT_PORTS
from specdec.worker.server import WorkerRole
from target_service.engine import TargetEngine
from target_service.servicer import TargetServicer

TARGET = WorkerRole("target", DEFAULT_PORTS["target"], TargetEngine, TargetServicer, target_pb2_grpc.add_TargetWorkerServicer_to_server,
                    target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name)
