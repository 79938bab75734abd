"""The client-facing orchestrator: runs the speculative loop and serves clients over gRPC.

Where a request goes: servicer.py (proto -> GenerationRequest) -> speculative.py
(SpeculativeDecoder, the round loop) -> workers.py interface, implemented by remote.py (gRPC
clients of the workers) or by the engines in-process (local.py) -> rejection_sampler.py for
the accept/reject math -> detokenizer.py for text and stop strings. client.py is the Python
client users import; server.py builds and runs the server.
"""
