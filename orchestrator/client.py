"""The Python clients of the orchestrator, Client (blocking) and AsyncClient (asyncio), as the
server's own code and tests import them.

They are defined once, in the client distribution (clients/python, `pip install
./clients/python`; import `specdec_client`), which installs without torch or transformers; see
specdec_client/client.py for their options (retries, load balancing, keepalive). A refused
request raises specdec.errors.ServiceError (the same class as specdec_client.ServiceError).
"""

from specdec_client.client import AsyncClient, Client  # noqa: F401

__all__ = ["AsyncClient", "Client"]
