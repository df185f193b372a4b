"""Model architectures by their HF `architectures` name (config.json).

An entry names the model class as a `"module:Class"` reference (imported when a model is
built, so validating a config never imports torch) and the ModelConfig flags that the
architecture implies but its HF config does not spell out (Qwen2's q/k/v bias, Qwen3's
q/k norms). A new architecture is its model module plus one `register_model` call:

    register_model("FooForCausalLM", ModelArch("my_pkg.foo:FooForCausalLM"))

The class is built as `cls(model_config)` on the meta device and must offer what
engine.models.llama.LlamaForCausalLM offers (load_hf_weights, fuse, forward,
compute_logits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine.registry import Registry, load_ref

_LLAMA = "engine.models.llama:LlamaForCausalLM"


@dataclass(frozen=True)
class ModelArch:
    model_class: Any  # the class, or "module:Class" imported on first use
    # ModelConfig fields fixed by the architecture (override what the HF config says)
    config_overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config_overrides", MappingProxyType(dict(self.config_overrides)))

    def load_class(self) -> Any:
        return load_ref(self.model_class)


MODELS: Registry[ModelArch] = Registry("model architecture")


def register_model(name: str, arch: ModelArch, *, help: str = "",
                   replace: bool = False) -> ModelArch:
    """Serve HF checkpoints whose config.json lists `name` in `architectures`."""
    return MODELS.register(name, arch, help=help, replace=replace)


def model_class(architecture: str) -> Any:
    """The model class of an architecture (ValueError listing the supported ones)."""
    return MODELS.get(architecture).load_class()


register_model("LlamaForCausalLM", ModelArch(_LLAMA), help="Llama 2/3, SmolLM")
register_model("MistralForCausalLM", ModelArch(_LLAMA), help="Mistral")
register_model("Qwen2ForCausalLM", ModelArch(_LLAMA, {"qkv_bias": True, "o_bias": False}),
               help="Qwen2/2.5: biased q/k/v projections")
register_model("Qwen3ForCausalLM", ModelArch(_LLAMA, {"qk_norm": True}),
               help="Qwen3: RMSNorm on q and k")
