"""The one cost model of pdserve: seconds for a step of a model on a device.

Both the simulator (sim/, on a virtual clock) and the emulated accelerator
(engine/emulate/, in the real service on the wall clock) ask it, so the two cannot
drift apart:

    calibration.py  the calibration file (measured, analytic or synthetic) and its errors
    model.py        CostModel (the questions), TableCosts (a measured calibration's tables)
    analytic.py     analytic profiles (h200 / h100 / a100 x model shapes): a roofline,
                    labelled "analytic, not measured"
    delivery.py     the control plane's token-delivery model (the simulator's)
    loader.py       load_costs: the CostModel a calibration describes

Plain Python and numpy: no torch, Ray or gRPC, and nothing above engine/.
"""
