"""Tools run by hand (`python -m tools.X`), not installed and reached by no `pdserve` verb:
GPU checks, control-plane profiling, micro benchmarks, the simulator's validation harness.
tools/README.md lists them.
"""
