"""The generated protobuf and gRPC modules of proto/specdec/v1/, under the server's name.

The one copy lives in the client distribution, clients/python/specdec_client/v1/ (written by
scripts/gen_protos.py; never edited by hand). Each `specdec.v1.X` here is that very module
object, so `from specdec.v1 import target_pb2` and `import specdec.v1.target_pb2` both work and
the server and the client share one set of message classes.
"""

import sys

from specdec_client.v1 import (common_pb2, common_pb2_grpc, draft_pb2, draft_pb2_grpc, orchestrator_pb2,
                               orchestrator_pb2_grpc, target_pb2, target_pb2_grpc)

__all__ = ["common_pb2", "common_pb2_grpc", "draft_pb2", "draft_pb2_grpc", "orchestrator_pb2",
           "orchestrator_pb2_grpc", "target_pb2", "target_pb2_grpc"]

for _name in __all__:
    sys.modules[f"{__name__}.{_name}"] = globals()[_name]
del _name
