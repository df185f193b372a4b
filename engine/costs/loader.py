"""The cost model a calibration describes: measured tables (engine/costs/model.py TableCosts) or an
analytic roofline profile (engine/costs/analytic.py RooflineCosts)."""

from __future__ import annotations

from engine.costs.analytic import RooflineCosts
from engine.costs.calibration import Calibration
from engine.costs.model import CostModel, TableCosts


def load_costs(cal: Calibration) -> CostModel:
    """The cost model a calibration file describes (measured tables or analytic)."""
    return RooflineCosts(cal) if cal.kind == "analytic" else TableCosts(cal)
