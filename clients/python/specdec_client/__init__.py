"""specdec-client: the Python client of the speculative decoding service's gRPC API.

    from specdec_client import Client
    with Client("localhost:50050") as client:
        print(client.generate(prompt="def fib(n):", max_new_tokens=64, temperature=0).text)

Client (blocking) and AsyncClient (asyncio) are documented in specdec_client.client; the
generated protobuf and gRPC modules are specdec_client.v1 (e.g. orchestrator_pb2_grpc, for
calling the API directly). Depends on grpcio, grpcio-health-checking and protobuf only.
"""

from specdec_client.channel import ClientTls
from specdec_client.client import AsyncClient, Client
from specdec_client.errors import ServiceError
from specdec_client.protocol import GenerationChunk, GenerationResult, TokenLogprob


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec-client")
    except PackageNotFoundError:  # imported from a checkout that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = ["AsyncClient", "Client", "ClientTls", "GenerationChunk", "GenerationResult", "ServiceError",
           "TokenLogprob", "__version__"]
