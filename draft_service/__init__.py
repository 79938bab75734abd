"""The draft worker: a small causal LM that proposes gamma tokens per round over gRPC.

`python -m draft_service` (__main__.py): role.py says what a draft worker is, specdec/worker/server.py
serves it, servicer.py maps gRPC to engine.py, which does the model work.
"""
