"""Matplotlib figures: metric vs knob, grouped bars, chunk-size panels, trace timeline.

Every function takes plain dicts/lists, writes one PNG and returns its path. Figures are
built with the object API on an Agg canvas (no pyplot, no global backend switch), so
they are safe to call from any thread or a headless machine.

    plot_metric_vs_knob({"fcfs": {256: 80.0, 512: 95.0}}, "ttft.png",
                        xlabel="chunk size (tokens)", ylabel="TTFT p99 (ms)")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.trace import assign_lanes, by_track, out_path, tracks
from engine.tracing import TraceEvent

# A series is {x: y} or [(x, y), ...]; y may be None/NaN for a missing point.
Series = Mapping[float, float | None] | Sequence[tuple[float, float | None]]

# (key in each chunk-size row, panel title, y label) of the 4-panel chunk-size figure.
CHUNK_PANELS: tuple[tuple[str, str, str], ...] = (
    ("ttft_p99_ms", "TTFT p99", "TTFT p99 (ms)"),
    ("itl_p99_ms", "ITL p99", "ITL p99 (ms)"),
    ("goodput_rps", "SLO goodput", "goodput (req/s)"),
    ("prefill_step_ms", "Mean prefill step time", "step time (ms)"),
)
# the fourth panel on an emulated device: per step, the device's busy time (kernel) and
# the host's lag before a continuing step (scheduling gap), of each role
STEP_PARTS: tuple[tuple[str, str], ...] = (
    ("prefill_kernel_ms", "prefill kernel"), ("prefill_gap_ms", "prefill gap"),
    ("decode_kernel_ms", "decode kernel"), ("decode_gap_ms", "decode gap"),
)


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (7.0, 4.5)) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _save(fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path := out_path(path), dpi=120)
    return path


def _points(series: Series) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (x, y) arrays; missing y become NaN (a gap in the line)."""
    items = list(series.items()) if isinstance(series, Mapping) else list(series)
    items.sort(key=lambda p: p[0])
    x = np.array([float(p[0]) for p in items])
    y = np.array([np.nan if p[1] is None else float(p[1]) for p in items])
    return x, y


def _draw_lines(ax: Any, series: Mapping[str, Series], logx: bool) -> None:
    knobs: set[float] = set()
    for name, s in series.items():
        x, y = _points(s)
        knobs.update(x.tolist())
        ax.plot(x, y, marker="o", label=str(name))
    if logx:  # base-2 spacing, but label the knob values themselves (128, not 2^7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(knobs), [f"{k:g}" for k in sorted(knobs)])
        ax.minorticks_off()
    ax.grid(alpha=0.3)


def plot_metric_vs_knob(
    series: Mapping[str, Series],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logx: bool = False,
    hline: float | None = None,
    hline_label: str = "SLO",
) -> Path:
    """One curve per series (e.g. policy -> {chunk size: TTFT p99 ms}).

    ``hline`` draws a dashed reference (an SLO); ``logx`` uses a base-2 x axis.
    """
    if not series:
        raise ValueError("series must not be empty")
    fig, axes = _figure()
    ax = axes[0][0]
    _draw_lines(ax, series, logx)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label=hline_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{ylabel} vs {xlabel}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_grouped_bars(
    data: Mapping[str, Mapping[str, float]],
    path: str | Path,
    *,
    ylabel: str,
    title: str,
    xlabel: str = "policy",
    annotate: bool = True,
) -> Path:
    """Grouped bars: one group per outer key (a policy), one bar per inner key (a metric).

    Metrics missing for a policy are left out of its group (no bar).
    """
    if not data:
        raise ValueError("data must not be empty")
    groups = list(data)
    metrics = list(dict.fromkeys(m for g in groups for m in data[g]))
    fig, axes = _figure(size=(max(7.0, 1.2 * len(groups) * max(1, len(metrics)) / 2 + 3), 4.5))
    ax = axes[0][0]
    width = 0.8 / max(1, len(metrics))
    base = np.arange(len(groups))
    for j, metric in enumerate(metrics):
        xs = [
            base[i] + (j - (len(metrics) - 1) / 2) * width
            for i, g in enumerate(groups)
            if metric in data[g]
        ]
        ys = [float(data[g][metric]) for g in groups if metric in data[g]]
        bars = ax.bar(xs, ys, width=width, label=metric)
        if annotate:
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
    ax.set_xticks(base, groups)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_chunk_size_study(
    results: Mapping[str, Mapping[int, Mapping[str, float | None]]],
    path: str | Path,
    *,
    title: str = "Chunk size study",
    slo_ttft_ms: float | None = None,
    slo_itl_ms: float | None = None,
    logx: bool = True,
) -> Path:
    """The 4-panel chunk-size figure: TTFT p99, ITL p99, SLO goodput, step time.

    ``results[series][chunk_size]`` is a row with the keys of :data:`CHUNK_PANELS`
    (``ttft_p99_ms``, ``itl_p99_ms`` — or ``tpot_p99_ms`` —, ``goodput_rps``,
    ``prefill_step_ms``); missing keys leave gaps. Optional SLO lines are dashed. Rows
    with the :data:`STEP_PARTS` keys (an emulated device's accounting) make the fourth
    panel kernel time and scheduling gap per step, one line per part (gaps dashed).
    """
    if not results:
        raise ValueError("results must not be empty")
    fig, axes = _figure(2, 2, size=(12.0, 8.0))
    use_tpot = not any("itl_p99_ms" in row for s in results.values() for row in s.values())
    slo = {"ttft_p99_ms": slo_ttft_ms, "itl_p99_ms": slo_itl_ms}
    parts = any(row.get(STEP_PARTS[0][0]) is not None for s in results.values()
                for row in s.values())
    for ax, (key, panel, ylabel) in zip(axes.flat, CHUNK_PANELS, strict=True):
        if key == "prefill_step_ms" and parts:
            _draw_step_parts(ax, results, logx)
            continue
        if key == "itl_p99_ms" and use_tpot:
            key, panel, ylabel = "tpot_p99_ms", "TPOT p99", "TPOT p99 (ms)"
            slo[key] = slo_itl_ms
        series = {
            name: {c: row.get(key) for c, row in rows.items()} for name, rows in results.items()
        }
        _draw_lines(ax, series, logx)
        if slo.get(key) is not None:
            ax.axhline(slo[key], color="gray", linestyle="--", linewidth=1, label="SLO")
        ax.set_title(f"{panel} vs chunk size")
        ax.set_xlabel("max prefill chunk (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def _draw_step_parts(ax: Any, results: Mapping[str, Mapping[int, Mapping[str, Any]]],
                     logx: bool) -> None:
    """The fourth chunk-size panel on an emulated device: kernel time and scheduling gap
    per step of each role (a series' name prefixes its lines when there are several)."""
    series = {part if len(results) == 1 else f"{name}: {part}":
              {c: row.get(key) for c, row in rows.items()}
              for name, rows in results.items() for key, part in STEP_PARTS}
    _draw_lines(ax, series, logx)
    for line in ax.get_lines():
        if line.get_label().endswith(" gap"):
            line.set_linestyle("--")
    ax.set_title("Kernel time + scheduling gap per step vs chunk size")
    ax.set_xlabel("max prefill chunk (tokens)")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)


_FAINT = {"request": 0.18, "queue": 0.35, "kv_queue": 0.35}  # waiting, not working: alpha
_GREY = (0.6, 0.6, 0.6, 1.0)
_SOLID_STYLE: dict = {"edgecolors": "black", "linewidths": 0.2}
_FAINT_STYLE: dict = {"edgecolors": "gray", "linewidths": 0, "hatch": "//"}


def plot_timeline(
    events: Sequence[TraceEvent],
    path: str | Path,
    *,
    title: str = "pdserve timeline",
    max_legend: int = 16,
    window: tuple[float, float] | None = None,
    requests: Iterable[str] | None = None,
) -> Path:
    """Gantt chart: one row per worker/link (lanes stacked inside), bars coloured by request.

    Waiting phases (queue, kv_queue, request) are drawn faint and hatched; instants
    (tokens, admissions) are ticks. x is seconds since the first event (wall clock);
    ``window=(from_s, to_s)`` zooms on that range and ``requests`` keeps only those ids.
    """
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.patches import Patch

    t0 = min((e.start for e in events), default=0.0)
    if requests is not None:
        keep = set(requests)
        events = [e for e in events if e.request_id in keep]
    if window is not None:
        events = [e for e in events if e.end >= t0 + window[0] and e.start <= t0 + window[1]]
    names = tracks(events)
    first: dict[str, float] = {}
    for e in events:
        first[e.request_id] = min(e.start, first.get(e.request_id, e.start))
    # colour order = order of appearance; batch-level events ("a,b", "*") are grey
    rids = [r for r in sorted(first, key=first.__getitem__) if r != "*" and "," not in r]
    fig, axes = _figure(size=(14.0, 1.5 + 0.7 * max(1, len(names))))
    ax = axes[0][0]
    # tab20 pairs dark/light shades of one hue: take the dark ones first (distinct hues)
    color = {r: colormaps["tab20"]((2 * i + (i // 10) % 2) % 20) for i, r in enumerate(rids)}
    solid: tuple[list, list] = ([], [])  # (bar vertices, face colours)
    faint: tuple[list, list] = ([], [])
    ticks: tuple[list, list] = ([], [])  # (segments, colours) of instants
    groups = by_track(events)
    for row, worker in enumerate(names):
        evs = groups[worker]
        lanes = assign_lanes(evs)
        h = 0.8 / (max(lanes, default=0) + 1)  # row height 0.8, split between lanes
        for e, lane in zip(evs, lanes, strict=True):
            x0, x1, y = e.start - t0, e.end - t0, row - 0.4 + lane * h
            if e.is_instant:
                ticks[0].append([(x0, row - 0.4), (x0, row + 0.4)])
                ticks[1].append(color.get(e.request_id, _GREY))
                continue
            verts, faces = faint if e.phase in _FAINT else solid
            verts.append([(x0, y), (x0, y + h), (x1, y + h), (x1, y)])
            faces.append((*color.get(e.request_id, _GREY)[:3], _FAINT.get(e.phase, 0.95)))
    for (verts, faces), style in ((solid, _SOLID_STYLE), (faint, _FAINT_STYLE)):
        ax.add_collection(PolyCollection(verts, facecolors=faces, **style))
    ax.add_collection(LineCollection(ticks[0], colors=ticks[1], linewidths=0.8))
    span = max((e.end for e in events), default=t0 + 1.0) - t0
    ax.set_xlim(*(window or (-0.01 * span, 1.01 * span if span > 0 else 1.0)))
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(max(len(names), 1) - 0.5, -0.5)  # first track on top
    ax.set_xlabel("time since first event (s, wall clock)")
    ax.set_ylabel("worker / link")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=color[r], label=r) for r in rids[:max_legend]]
    if handles:
        ax.legend(
            handles=handles, title="request", fontsize=7, loc="upper left", bbox_to_anchor=(1, 1)
        )
    return _save(fig, path)
