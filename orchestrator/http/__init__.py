"""The OpenAI-compatible HTTP front door of the orchestrator (`--http-port`).

    POST /v1/completions        prompt -> text (stream: server-sent events ending in `data: [DONE]`)
    POST /v1/chat/completions   messages -> an assistant message (the same, streamed)
    GET  /v1/models             the one model this orchestrator serves
    POST /tokenize              prompt or messages -> token ids, as the decoder would encode them
    GET  /health                200 while serving, 503 otherwise (no token needed)
    GET  /metrics               Prometheus text of the orchestrator's metrics, as vLLM serves it (no token needed)

It runs beside the gRPC server in the same process (uvicorn on a thread of its own) and feeds the
same decoder through the same admission queue: one decoding loop, one limit on requests running
and waiting. A request goes, in this package:

    transport.py  HttpServer (uvicorn, slow-client limits, unparseable requests) -> Guard (bearer
                  token, body size and pace, before the app reads a byte)
    app.py        FrontDoor: the routes; a body validated into schemas.py's records, turned into a
                  GenerationRequest, run on a pool thread through the admission queue and decoder
    render.py     Answer: the decoder's chunks as one OpenAI response body or server-sent events
    errors.py     OpenAIError and the mapping from ServiceError (status from specdec/errors.py)

Mapping to the decoder (orchestrator/decoder.py): max_tokens / max_completion_tokens ->
max_new_tokens (completions default to 16 as OpenAI's do; chat to as many as fit the context and
--max-new-tokens); temperature, top_p, seed, stop as they are; extensions, e.g. the openai SDK's
`extra_body`: `top_k` (0 or -1: off), `gamma` (drafts per round; 0 = the target alone) and
`sampling_mode` ("coupled", the server's default unless --sampling says otherwise: the same answer
for a seed whatever the load or gamma, the seed drawn by the server and reported when the request
has none; "rejection").
Every answer carries the speculative statistics in the extension field `specdec` (the last
chunk of a stream). Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""
