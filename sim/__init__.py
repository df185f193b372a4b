"""pdserve's cluster simulator: the real policy code on a simulated clock (sim/README.md).

    from sim.cluster import Simulation, simulate_config
    from sim.cost_loader import load_costs
    from sim.calibration import Calibration
"""
