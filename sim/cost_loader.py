"""The cost model a calibration describes: measured tables (sim/costs.py TableCosts) or an
analytic roofline profile (sim/analytic.py RooflineCosts)."""

from __future__ import annotations

from sim.analytic import RooflineCosts
from sim.calibration import Calibration
from sim.costs import CostModel, TableCosts


def load_costs(cal: Calibration) -> CostModel:
    """The cost model a calibration file describes (measured tables or analytic)."""
    return RooflineCosts(cal) if cal.kind == "analytic" else TableCosts(cal)
