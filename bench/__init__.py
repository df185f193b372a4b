"""pdserve study bench: workloads, client, metrics, traces, sweeps and plots.

Modules are imported directly (``from bench.workload import build_workload``); this
package file imports nothing so that ``import bench`` stays cheap (no matplotlib).
"""

from __future__ import annotations
