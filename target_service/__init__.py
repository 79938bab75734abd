"""The target worker: the large causal LM that verifies a round's drafts in one forward pass.

engine.py does the model work, servicer.py maps gRPC to the engine, server.py builds and runs
the server, __main__.py is `python -m target_service`.
"""
