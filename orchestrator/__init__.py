"""The client-facing orchestrator: serves clients over gRPC and HTTP and runs speculative decoding.

Where a request goes: servicer.py (gRPC; http/ for the OpenAI-compatible door) turns it into a
GenerationRequest and admission.py gives it a turn; decoder.py (SpeculativeDecoder) checks it
(validation.py, the same for both doors), places its sessions (placement.py, on the pools of
pool.py) and hands it to the step loop of its target (steps.py). Each step the gamma policy (gamma.py) chooses every request's drafts,
the draft and the target are called once each for all requests (workers.py's interface: remote.py
over gRPC, or the engines in-process), and rounds.py finishes each request's round: rejection
sampling (rejection_sampler.py), rollback, stop strings and text (detokenizer.py). Model-free
drafts are in proposers/. server.py builds the server, serve.py is `specdec serve`, cli.py the
`specdec` command; client.py re-exports the Python client.
"""
