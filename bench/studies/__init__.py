"""The sweeps behind `pdserve study NAME`: one module per study, shared plumbing beside them.

Each module imports only those below it (a contract in pyproject.toml checks it):

    chunk_size.py pacing.py fairness.py interference.py baseline.py teaching.py   the studies
    common.py     the studies' one import (re-exports the rest) and the mixed workload
    results.py    table columns, StudyResult, NAME.json / NAME.md
    context.py    StudyOptions, StudyContext (model, reference, link, services, run)
    traces.py     per-configuration trace files and trace summaries
    config_run.py one configuration's run: records, metrics, table figures
    service.py    a launched configuration (router + gRPC server), a pool that reuses them
    link.py       link emulation: KV bytes vs prefill time -> an emulated link rate
"""

from __future__ import annotations
