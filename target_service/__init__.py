"""The target worker: the large causal LM that verifies a round's drafts in one forward pass.

`python -m target_service` (__main__.py): role.py says what a target worker is, specdec/worker/server.py
serves it, servicer.py maps gRPC to engine.py, which does the model work.
"""
