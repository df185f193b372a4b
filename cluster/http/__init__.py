"""The OpenAI-compatible HTTP door: `api.build_app` (the Starlette app over a RouterAPI),
`protocol` (request bodies), `responses` (response bodies and SSE chunks), `run.OpenAIRun`
(tokens -> text pieces, stop strings), `stream`, `logprobs`, `stop_strings`, and
`asgi_server.HttpServer` (uvicorn on the caller's loop).
"""
