"""The emulated model's directory: what the service loads for a model shape it emulates.

``config.json`` of the shape (engine.costs.analytic SHAPES: the published config's
architecture and sizes), ``generation_config.json`` and a real tokenizer of the shape's
vocabulary size, and no weights (the emulated device computes nothing). The tokenizer is
pdserve's byte-level BPE of the embedded model (engine/tiny_model.py, 2,048 ids), its
vocabulary extended with placeholder tokens ``<|emu:N|>`` up to the shape's size: text
prompts encode as with the tiny model, and every pseudo-token the emulated model draws
decodes to text. Written once per shape under ~/.cache/pdserve/models/, deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "pdserve_emulated.json"  # names the shape the directory stands for


def emulated_model_dir(shape: str, root: Path | None = None) -> Path:
    """The directory of ``shape`` (written on first use)."""
    from engine.costs.analytic import SHAPES

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
    root = root or Path.home() / ".cache" / "pdserve" / "models"
    out = root / f"emulated-{shape}"
    if (out / MARKER).exists():
        return out
    _write(out, shape, SHAPES[shape])
    return out


def _write(out: Path, shape: str, s: dict) -> None:
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from engine.tiny_model import EOS, train_tokenizer

    base = train_tokenizer()
    vocab = s["vocab_size"]
    if vocab < len(base):
        raise ValueError(f"model shape {shape!r} has {vocab} token ids, fewer than the "
                         f"tokenizer's {len(base)}")
    spec = json.loads(base.backend_tokenizer.to_str())
    ids = spec["model"]["vocab"]
    for i in range(len(ids), vocab):
        ids[f"<|emu:{i}|>"] = i
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    PreTrainedTokenizerFast(tokenizer_file=str(tmp / "tokenizer.json"), bos_token=EOS,
                            eos_token=EOS, pad_token=EOS).save_pretrained(tmp)
    eos = ids[EOS]
    kind = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[s["architecture"]]
    cfg = AutoConfig.for_model(
        kind, architectures=[s["architecture"]], vocab_size=vocab,
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
        max_position_embeddings=s["max_position_embeddings"],
        tie_word_embeddings=s["tie_word_embeddings"], bos_token_id=eos, eos_token_id=eos,
        torch_dtype="bfloat16")
    cfg.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}))
    (tmp / MARKER).write_text(json.dumps({"shape": shape, **s}, indent=1))
    if out.exists():  # a half-written one from an interrupted run
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
