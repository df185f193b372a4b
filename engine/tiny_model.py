"""Deterministic random HF-format model directories (the embedded default model).

Writes `config.json`, `generation_config.json`, `model.safetensors` and a real byte-level
BPE tokenizer trained by `tokenizers` on `engine/data/corpus.txt`, so that
`transformers.AutoModelForCausalLM.from_pretrained(dir)` loads it as a reference.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
EOS = "<|endoftext|>"
ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int | None  # None: the tokenizer's size
    max_position_embeddings: int
    rope_theta: float
    std: float


PRESETS = {
    "tiny": Preset(64, 128, 2, 4, 2, 16, None, 4096, 10000.0, 0.08),
    # SmolLM2-135M's head layout (9 query heads over 3 KV heads) at tiny size: TP = 3 tests
    "tiny-9h": Preset(72, 96, 2, 9, 3, 8, None, 4096, 10000.0, 0.08),
    "small": Preset(256, 512, 4, 8, 2, 32, None, 8192, 10000.0, 0.05),
    # the shape of Qwen2-0.5B: the benchmark model
    "qwen2-0.5b-shape": Preset(896, 4864, 24, 14, 2, 64, 151936, 32768, 1000000.0, 0.02),
}
TOKENIZER_VOCAB = 2048


@functools.lru_cache(maxsize=2)
def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """Byte-level BPE trained on the shipped corpus (deterministic for a given corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS
    )


def _hf_config(preset: Preset, arch: str, vocab_size: int, eos_id: int):
    from transformers import AutoConfig

    kind = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}[arch]
    kwargs = dict(
        architectures=[ARCHS[arch]],
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=preset.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=arch in ("qwen2", "qwen3"),
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        torch_dtype="float32",
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    return AutoConfig.for_model(kind, **kwargs)


def _random_weights(hf_config, std: float, seed: int) -> dict[str, torch.Tensor]:
    """Seeded tensors for every parameter, named and shaped as transformers expects."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(hf_config)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in shapes.named_parameters():  # tied lm_head is not listed separately
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            t = std * torch.randn(p.shape, generator=gen)
        out[name] = t.contiguous()
    return out


def preset_config(preset: str = "tiny", arch: str = "llama"):
    """The transformers config `make_model` writes for (preset, arch); writes nothing."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    p = PRESETS[preset]
    tokenizer = train_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    return _hf_config(p, arch, p.vocab_size or len(tokenizer), eos_id)


def make_model(
    out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0
) -> Path:
    """Write a model directory; returns its path. Same arguments, same bytes."""
    from safetensors.torch import save_file

    cfg = preset_config(preset, arch)
    eos_id = cfg.eos_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    cfg.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False})
    )
    save_file(_random_weights(cfg, PRESETS[preset].std, seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def default_model_dir(preset: str = "tiny", arch: str = "llama") -> Path:
    """Cache location of the embedded default models (created on first use)."""
    root = Path.home() / ".cache" / "pdserve" / "models"
    return root / f"{preset}-{arch}"


def ensure_model(preset: str = "tiny", arch: str = "llama") -> Path:
    d = default_model_dir(preset, arch)
    if not (d / "model.safetensors").exists():
        make_model(d, preset, arch)
    return d
