"""Tensor parallelism (Megatron style) for the engine: see README.md in this folder.

engine.config.Shard   which heads / KV heads / MLP rows a rank holds (plain Python)
state.py              this process's group (gloo on CPU, NCCL on CUDA), control channel
layers.py             the all-reduce after the row-parallel projections (forward hooks)
loader.py             a rank's slice of an HF checkpoint (safetensors get_slice)
engine/tp_driver.py   rank 0 broadcasts each step; ranks > 0 serve them; KV gather/scatter
engine/tp_launch.py   a one-host group of child processes for engine.LLM

(The driver and the launcher sit beside engine.model_runner, which they build on; this
package sits below it.)
"""
