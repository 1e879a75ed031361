"""An OpenAI-compatible HTTP front end for the Triton ensemble.

FastAPI + uvicorn beside Triton, as Triton's own OpenAI frontend is: `/v1/models`,
`/v1/completions`, `/v1/chat/completions` (streaming over server-sent events and not),
`/health`. Each request is forwarded to the `ensemble` over tritonclient's asyncio gRPC
streaming; a client that disconnects cancels its request in the engine.

- `protocol`: the OpenAI request bodies (pydantic), their mapping to ensemble inputs,
  and the response bodies;
- `triton_backend`: the asyncio gRPC stream to Triton;
- `app`: the FastAPI application (`create_app`).

`make serve-openai` (tools/serve_openai.py) starts it; docs/CLIENTS.md describes it.
"""
