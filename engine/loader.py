"""HF model directory -> ModelConfig, weights and tokenizer.

Config through `transformers.AutoConfig`, weights through `safetensors`, tokenizer through
`transformers.AutoTokenizer`. Errors name the missing file or the unsupported field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.registry import MODELS, model_class


class ModelLoadError(ValueError):
    """A model directory is missing a file or describes an unsupported model."""


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise ModelLoadError(f"{what} not found: {path}")
    return path


def _rope(hf_config) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    if rope_type == "default":
        theta = (params or {}).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return tuple(inv.tolist()), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}")
    if rope_type == "dynamic":
        raise ModelLoadError("dynamic NTK rope scaling is not supported (use 'llama3' or none)")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return tuple(inv.float().tolist()), float(scaling)


def _eos_ids(model_dir: Path, hf_config) -> tuple[int, ...]:
    gen = model_dir / "generation_config.json"
    eos = None
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    cfg_path = _require(model_dir / "config.json", "config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from e
    archs = raw.get("architectures") or [] if isinstance(raw, dict) else []
    arch = next((a for a in archs if a in MODELS), None)
    if arch is None:  # checked before AutoConfig, whose error would not name the file
        raise ModelLoadError(
            f"{cfg_path}: architectures {archs} not supported; supported: {list(MODELS)}"
        )
    try:
        hf = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{cfg_path}: transformers cannot read it ({e})") from e
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {hf.hidden_act!r} not supported (only 'silu')")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    inv_freq, scaling = _rope(hf)
    attn_bias = bool(getattr(hf, "attention_bias", False))
    fields = dict(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=attn_bias,
        o_bias=attn_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=False,
        rope_inv_freq=inv_freq,
        rope_attention_scaling=scaling,
        eos_token_ids=_eos_ids(model_dir, hf),
        bos_token_id=getattr(hf, "bos_token_id", None),
    )
    # what the architecture fixes (Qwen2's q/k/v bias, Qwen3's q/k norms) wins
    return ModelConfig(**{**fields, **MODELS.get(arch).config_overrides})


def weight_files(model_dir: str | Path) -> list[Path]:
    """`model.safetensors`, or the shards named by `model.safetensors.index.json`."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        raise ModelLoadError(
            f"no weights in {model_dir}: expected model.safetensors or "
            "model.safetensors.index.json"
        )
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    return [_require(model_dir / shard, "weight shard") for shard in sorted(set(weight_map.values()))]


def iter_weights(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, one at a time, converted to `device` and
    `dtype` as it is read: at most one tensor in the checkpoint's dtype is alive at once,
    so an fp32 checkpoint never exists as a whole in memory on the way to bf16."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                t = f.get_tensor(name)
                if t.is_floating_point() and dtype is not None:
                    t = t.to(device=device, dtype=dtype)
                else:
                    t = t.to(device=device)
                yield name, t


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint as they are stored (CPU, the checkpoint's dtype)."""
    return dict(iter_weights(model_dir))


def load_model(
    config: ModelConfig, model_dir: str | Path, device: torch.device | str, dtype: torch.dtype
) -> torch.nn.Module:
    """Build the class registered for `config.architecture` (engine.models.registry) on
    the `meta` device (no memory, no random init) and install the checkpoint's tensors,
    converted one by one, as its parameters on `device` in `dtype`."""
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    model.load_hf_weights(dict(iter_weights(model_dir, device, dtype)))
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if on_meta:  # not reachable through load_hf_weights' check; a clear error all the same
        raise ModelLoadError(f"{model_dir}: no weights for {on_meta[:5]}")
    return model.eval()


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").exists() and not (
        model_dir / "tokenizer_config.json"
    ).exists():
        raise ModelLoadError(f"tokenizer.json not found in {model_dir}")
    return AutoTokenizer.from_pretrained(model_dir)
