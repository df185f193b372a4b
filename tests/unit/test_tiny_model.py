"""tiny_model: deterministic bytes, loadable by transformers, presets with the stated
shapes (the 0.5B-shape preset is checked on the meta device, never materialised)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from engine.tiny_model import (
    ARCHS,
    PRESETS,
    TOKENIZER_VOCAB,
    default_model_dir,
    ensure_model,
    make_model,
    preset_config,
)

FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json")


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_arguments_give_the_same_bytes(tmp_path, model_dirs):
    again = make_model(tmp_path / "again", "tiny", "qwen2")
    for name in FILES:
        assert digest(again / name) == digest(model_dirs["qwen2"] / name), name
    other = make_model(tmp_path / "other", "tiny", "qwen2", seed=1)
    assert digest(other / "model.safetensors") != digest(again / "model.safetensors")
    assert digest(other / "config.json") == digest(again / "config.json")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_loadable_by_transformers_auto_classes(model_dirs, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert type(model).__name__ == ARCHS[arch]
    tok = AutoTokenizer.from_pretrained(d)
    text = "Simple is better than complex."
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < model.config.vocab_size
    assert tok.eos_token_id == model.config.eos_token_id == 0
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_mistral_arch_is_loadable(tmp_path):
    from transformers import AutoModelForCausalLM

    d = make_model(tmp_path / "mistral", "tiny", "mistral")
    assert type(AutoModelForCausalLM.from_pretrained(d)).__name__ == "MistralForCausalLM"


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_preset_config_has_the_stated_shapes(preset, arch):
    p = PRESETS[preset]
    cfg = preset_config(preset, arch)
    assert cfg.architectures == [ARCHS[arch]]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        p.hidden_size, p.intermediate_size, p.num_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        p.num_heads, p.num_kv_heads, p.head_dim)
    assert cfg.vocab_size == (p.vocab_size or TOKENIZER_VOCAB)
    assert cfg.max_position_embeddings == p.max_position_embeddings
    assert cfg.tie_word_embeddings == (arch in ("qwen2", "qwen3"))


def test_qwen2_05b_shape_matches_qwen2_0_5b_on_the_meta_device():
    from transformers import AutoModelForCausalLM

    cfg = preset_config("qwen2-0.5b-shape", "qwen2")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (896, 4864, 24)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (14, 2, 64)
    assert cfg.vocab_size == 151936 and cfg.max_position_embeddings == 32768
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # Qwen2-0.5B's published parameter count (tied embeddings counted once)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    q = model.model.layers[0].self_attn
    assert q.q_proj.weight.shape == (896, 896) and q.k_proj.weight.shape == (128, 896)
    assert q.q_proj.bias is not None and q.o_proj.bias is None


def test_unknown_preset_or_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_model(tmp_path / "x", "huge")
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        preset_config("tiny", "gpt2")


def test_ensure_model_writes_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    d = ensure_model("tiny", "llama")
    assert d == default_model_dir("tiny", "llama") and str(d).startswith(str(tmp_path))
    before = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", "llama") == d
    assert (d / "model.safetensors").stat().st_mtime_ns == before
