"""The sweeps behind `pdserve study NAME`: one module per study, shared plumbing beside them.

    common.py     StudyOptions, StudyContext (model, reference, link, services), ConfigRun
    link.py       link emulation: KV bytes vs prefill time -> an emulated link rate
    service.py    a launched configuration (router + gRPC server) and a pool that reuses them
    results.py    table columns, StudyResult, NAME.json / NAME.md
    traces.py     per-configuration trace files and trace summaries
    chunk_size.py pacing.py fairness.py interference.py baseline.py teaching.py   the studies
"""

from __future__ import annotations
