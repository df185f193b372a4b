"""pdserve's cluster simulator: the real policy code on a simulated clock (sim/README.md).

    from sim.cluster import Simulation, simulate_config
    from engine.costs.loader import load_costs
    from engine.costs.calibration import Calibration
"""
