"""The gRPC front door's parts: `servicer.GenerationServicer` (validation at the door,
streaming, cancellation), `intake.PromptIntake` (a GenerateRequest -> a validated spec, for
every door), `wire` (the Generate stream's messages as bytes), `health`, `auth` (bearer
tokens, TLS), `convert` (wire messages <-> cluster.router.types) and `client.PdserveClient`.
The process that serves them is cluster/serve/server.py.
"""
