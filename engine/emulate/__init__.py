"""The emulated accelerator: the real service (actors, sockets, KV bytes) at the speed
the cost model (engine/costs/) gives for an H200, H100 or A100 running a model shape.

    device.py      the device timeline (a step submitted late starts late) and the host
                   accounting: device busy, host lag
    kv_pattern.py  the emulated model's KV: real bytes of the shape's size, a function of
                   (tokens up to a position, layer, position), checked on every import
    runner.py      EmulatedRunner: ModelRunner's interface; pseudo-tokens from the KV state
    model_dir.py   the emulated model's directory (config.json of the shape, a tokenizer of
                   its vocabulary size, no weights)

A labelled device model: every figure measured on it says "emulated <profile>, <shape>:
analytic, not measured" (EmulateConfig.label).
"""
