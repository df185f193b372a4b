"""The serving process: `server.GenerationServer` (gRPC + the OpenAI HTTP door over one
RouterAPI), `startup.build_router` (a ServeConfig -> a running router), `front_doors` and
`front_door` (`--api-servers N`: N processes on one port).
"""
