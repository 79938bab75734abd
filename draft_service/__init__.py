"""The draft worker: a small causal LM that proposes gamma tokens per round over gRPC.

engine.py does the model work, servicer.py maps gRPC to the engine, server.py builds and runs
the server, __main__.py is `python -m draft_service`.
"""
