"""The simulator's cost model from its sources: a calibration file, or an analytic
profile for a model shape (a shape name of engine/costs/, or a model directory whose
config gives it) -- the `pdserve simulate` / `plan` flags' and the live planner's."""

from __future__ import annotations

from pathlib import Path


def cost_model(calibration: str | None, analytic: str | None, shape: str | None,
               dtype: str, assumptions: dict | None = None):
    """``calibration`` wins; else ``analytic`` (h200, h100, a100) for ``shape`` (default
    llama-3-8b) in ``dtype``, with ``assumptions`` over engine/costs/analytic.py's."""
    from engine.costs.analytic import analytic_calibration
    from engine.costs.calibration import Calibration
    from engine.costs.loader import load_costs

    if calibration:
        return load_costs(Calibration.load(calibration))
    if analytic is None:
        raise ValueError("a cost model needs a calibration file or an analytic profile")
    shape = shape or "llama-3-8b"
    if Path(shape).is_dir():
        from sim.adapters import engine_tools

        mc = engine_tools().load_model_config(shape)
        shape = {"name": Path(shape).name, **{k: getattr(mc, k) for k in (
            "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
            "tie_word_embeddings")}}
    return load_costs(analytic_calibration(analytic, shape, dtype, assumptions))
