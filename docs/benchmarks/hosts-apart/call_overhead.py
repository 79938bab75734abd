"""What making worker calls cancellable costs: a blocking unary call against a future (what
_RemoteWorker._call makes, so the pool can cancel it), 1,000 Describe calls each, three rounds,
on a tiny target worker over loopback.

  .venv/bin/python docs/benchmarks/hosts-apart/call_overhead.py
"""
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.support.processes import WorkerProcess
from specdec_tools.testing.tiny_models import build_model_dir
import tempfile
from specdec.v1 import common_pb2
root = Path(tempfile.mkdtemp())
d = build_model_dir(root / "t", seed=1, layers=2)
w = WorkerProcess("target", d)
w.wait_serving()
from orchestrator.remote import RemoteTarget
r = RemoteTarget(w.address, timeout_s=10)
req = common_pb2.DescribeRequest()
for _ in range(200): r._stub.Describe(req, timeout=5)
def blocking():
    return r._stub.Describe(req, timeout=5)
def fut():
    return r._stub.Describe.future(req, timeout=5).result()
def ours():
    return r._call(r._stub.Describe, req, 5)
for rep in range(3):
  for name, f in (("blocking", blocking), ("future", fut), ("_call", ours)):
    t = time.perf_counter()
    for _ in range(1000): f()
    print(rep, name, f"{(time.perf_counter()-t)*1e3/1000:.3f} ms/call")
r.close(); w.stop()
