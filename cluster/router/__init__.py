"""The router: a request's life across the two pools, in the server process.

Public face: `router.Router` (the disaggregated RouterAPI), `types` (the dataclasses and the
`RouterAPI` contract the front doors speak), `policies` (prefill placement and decode order by
name, shared with the simulator), `admission.AdmissionCore` (decode admission),
`pool.WorkerHandle` (a worker as the router sees it), `channel.WorkerChannel` (the per-step
control channel's router end). The rest (flight, events, upkeep, liveness, admin,
delta_stream) are the router's own parts.
"""
