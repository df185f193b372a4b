"""Loader: clear errors naming the missing file or the unsupported field, and sharded
safetensors (with an index) loading to the same greedy output as the single file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.loader import ModelLoadError, load_model_config, load_tokenizer, load_weights

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(10, 31)), list(range(100, 107))]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def shard(src: Path, dst: Path, num_shards: int = 3) -> Path:
    """Write `src` as `model-0000i-of-0000n.safetensors` shards plus the HF index."""
    copy_model(src, dst, skip=("model.safetensors",))
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return dst


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def assert_no_leak(llm: LLM) -> None:
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0


# ---- sharded checkpoints -------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied embeddings
def test_sharded_safetensors_with_index_give_the_same_greedy_output(model_dirs, tmp_path, arch):
    src = model_dirs[arch]
    sharded = shard(src, tmp_path / "sharded")
    assert not (sharded / "model.safetensors").exists()
    single, split = load_weights(src), load_weights(sharded)
    assert single.keys() == split.keys()
    assert all(torch.equal(single[k], split[k]) for k in single)
    want = [o.token_ids for o in LLM(str(src)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(sharded))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert_no_leak(llm)


# ---- clear errors --------------------------------------------------------------------
def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found: .*nowhere"):
        LLM(str(tmp_path / "nowhere"))


def test_missing_config_json_is_named(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m", skip=("config.json",))
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        LLM(str(d))
    assert issubclass(ModelLoadError, ValueError)


def test_missing_weights_are_named(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        LLM(str(d))


def test_missing_shard_is_named(tiny_model, tmp_path):
    d = shard(tiny_model, tmp_path / "m")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00003\.safetensors"):
        LLM(str(d))


def test_missing_tokenizer_is_named(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m", skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(d)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(str(d))


def test_weights_that_do_not_match_the_config_are_rejected(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing=.*layers\.1\.mlp\.up_proj"):
        LLM(str(d))


def test_unsupported_architecture_is_named(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m")
    edit_config(d, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ModelLoadError, match="LlamaForSequenceClassification.*not supported"):
        load_model_config(d)
    with pytest.raises(ModelLoadError, match="not supported"):
        LLM(str(d))


def test_unsupported_activation_is_named(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m")
    edit_config(d, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu'"):
        load_model_config(d)


def test_config_of_each_architecture_is_read(model_dirs):
    for arch, qkv_bias, qk_norm, tied in (("llama", False, False, False),
                                          ("qwen2", True, False, True),
                                          ("qwen3", False, True, True)):
        cfg = load_model_config(model_dirs[arch])
        assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_word_embeddings) == (qkv_bias, qk_norm, tied)
        assert cfg.num_heads == 4 and cfg.num_kv_heads == 2 and cfg.head_dim == 16
        assert len(cfg.rope_inv_freq) == cfg.head_dim // 2
        assert cfg.eos_token_ids == (0,)


def test_model_type_unknown_to_transformers_names_the_config(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m")
    edit_config(d, model_type="not_a_model", architectures=["NotAModelForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"config\.json: architectures .*NotAModel"):
        load_model_config(d)


def test_corrupt_config_json_is_named(tiny_model, tmp_path):
    d = copy_model(tiny_model, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        LLM(str(d))


# ---- start-up: meta-device build, weights straight to their dtype ------------------------
def _reference_model(model_dir: Path, dtype: torch.dtype):
    """The old start-up: an fp32 model with random init, the checkpoint copied in, `.to()`."""
    from engine.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(load_model_config(model_dir))
    model.load_hf_weights(load_weights(model_dir))
    return model.to(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied embeddings
def test_meta_build_loads_the_same_parameters_in_the_target_dtype(model_dirs, arch, dtype,
                                                                  monkeypatch):
    from engine import loader

    d = model_dirs[arch]
    init_devices: list[str] = []
    real_init = torch.nn.init.kaiming_uniform_

    def spy_init(*a, **kw):  # nn.Linear's random init: must only ever see meta tensors
        init_devices.append((kw["tensor"] if "tensor" in kw else a[0]).device.type)
        return real_init(*a, **kw)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy_init)
    model = loader.load_model(load_model_config(d), d, "cpu", dtype)
    assert init_devices and set(init_devices) == {"meta"}
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in params.values())
    monkeypatch.undo()
    ref = dict(_reference_model(d, dtype).named_parameters(remove_duplicate=False))
    assert params.keys() == ref.keys()
    assert all(torch.equal(params[k], ref[k]) for k in params)
    if arch == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_fp32_checkpoint_is_converted_tensor_by_tensor(tiny_model, monkeypatch):
    """Loading bf16 from fp32 safetensors keeps at most one fp32 tensor alive at a time."""
    import weakref

    from engine import loader

    sources: list[weakref.ref] = []
    real_open = loader.safe_open

    class Spy:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            alive = [r for r in sources if r() is not None]
            assert not alive, f"{len(alive)} fp32 checkpoint tensors still alive"
            t = self.f.get_tensor(name)
            assert t.dtype == torch.float32
            sources.append(weakref.ref(t))
            return t

    n_tensors = len(load_weights(tiny_model))
    monkeypatch.setattr(loader, "safe_open", Spy)
    model = loader.load_model(load_model_config(tiny_model), tiny_model, "cpu", torch.bfloat16)
    assert len(sources) == n_tensors
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_rotary_frequencies_stay_fp32_in_a_bf16_runner(tiny_model):
    llm = LLM(str(tiny_model), dtype="bfloat16", num_blocks=8)
    model = llm.runner.model
    inv = model.inv_freq(torch.device("cpu"))
    assert inv.dtype == torch.float32
    assert inv.tolist() == list(llm.config.model.rope_inv_freq)  # not rounded to bf16
    model.to(dtype=torch.bfloat16)  # a later cast must not round them either
    assert model.inv_freq(torch.device("cpu")).tolist() == list(llm.config.model.rope_inv_freq)
