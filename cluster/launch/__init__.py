"""Starting the pools: `launcher.build_disaggregated_router` (Ray, placement, worker actors,
a Router that owns them), `placement` (what each worker asks Ray for), `worker_specs`
(ServeConfig -> each worker's typed configs, translated once), `tp_groups` (tensor-parallel
ranks), `colocated_pool` (colocated engines as actors), `local_backend.LocalBackend`
(`serve --colocated`), `faults` (finding and killing workers for chaos runs).
"""
