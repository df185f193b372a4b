"""Tensor parallelism in the engine (engine.parallel): shard layout, sliced loading, and
greedy output of `LLM(..., tensor_parallel_size=N)` equal to transformers' (fp32, CPU,
gloo) for TP = 2 (the tiny model) and TP = 3 (9 heads over 3 KV heads)."""

from __future__ import annotations

import dataclasses

import psutil
import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.config import EngineConfig, Shard, check_tp
from engine.loader import load_model_config
from engine.parallel.loader import iter_shard
from engine.tiny_model import make_model
from tests.unit.test_engine_exactness import hf_greedy, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_9h(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m9h") / "llama", "tiny-9h", "llama")


def _model(**kw):
    cfg = dict(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16,
               intermediate_size=24, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=2,
               rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
               qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    from engine.config import ModelConfig

    return ModelConfig(**{**cfg, **kw})


def test_shards_split_heads_and_replicate_kv_heads_when_fewer_than_ranks():
    m = _model()  # 8 heads over 2 KV heads
    four = [Shard.of(m, 4, r) for r in range(4)]
    assert [s.heads for s in four] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.kv_heads for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.kv_owner for s in four] == [True, False, True, False]
    assert [s.mlp for s in four] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    two = [Shard.of(m, 2, r) for r in range(2)]
    assert [s.kv_heads for s in two] == [(0, 1), (1, 2)] and all(s.kv_owner for s in two)
    local = four[1].local_config(m)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 6)
    assert local.tie_word_embeddings and not four[0].local_config(m).tie_word_embeddings


@pytest.mark.parametrize(("kw", "size", "words"), [
    ({}, 3, "num_attention_heads=8"),
    ({"num_heads": 12, "num_kv_heads": 6, "intermediate_size": 24}, 4, "num_key_value_heads=6"),
    ({"num_heads": 12, "num_kv_heads": 4}, 6, "larger than num_key_value_heads=4"),
    ({"intermediate_size": 30}, 4, "intermediate_size=30"),
])
def test_sizes_that_do_not_divide_the_model_are_refused_with_the_numbers(kw, size, words):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size}.*{words}"):
        check_tp(_model(**kw), size)
    with pytest.raises(ValueError, match=words):
        EngineConfig("x", _model(**kw), tensor_parallel_size=size)


def test_each_rank_reads_only_its_slices_and_the_slices_make_the_whole(model_9h):
    cfg = load_model_config(model_9h)
    with safe_open(str(model_9h / "model.safetensors"), "pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    ranks = [dict(iter_shard(cfg, model_9h, Shard.of(cfg, 3, r), "cpu", torch.float32))
             for r in range(3)]
    name = "model.layers.1.self_attn."
    assert ranks[1][name + "q_proj.weight"].shape == (3 * 8, 72)  # 3 of 9 heads
    assert ranks[1][name + "k_proj.weight"].shape == (8, 72)  # 1 of 3 KV heads
    for part, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)):
        whole = torch.cat([r[name + part + ".weight"] for r in ranks], dim=dim)
        assert torch.equal(whole, full[name + part + ".weight"]), part
    mlp = "model.layers.0.mlp."
    assert torch.equal(torch.cat([r[mlp + "down_proj.weight"] for r in ranks], dim=1),
                       full[mlp + "down_proj.weight"])
    assert torch.equal(ranks[2]["model.norm.weight"], full["model.norm.weight"])
    assert "lm_head.weight" in ranks[0] and "lm_head.weight" not in ranks[1]


def _check(llm: LLM, model_dir, prompts) -> None:
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(model_dir, p, GREEDY.max_tokens), f"prompt len {len(p)}"
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


@pytest.mark.parametrize(("block_size", "chunk"), [(16, 7), (8, 16), (1, 5)])
def test_tp2_greedy_matches_transformers(tiny_model, block_size, chunk):
    prompts = [prompt(n, seed=n) for n in (chunk - 1, chunk + 1, 3 * chunk + 5, 40)]
    with LLM(str(tiny_model), block_size=block_size, max_prefill_chunk=chunk,
             max_num_batched_tokens=3 * chunk, tensor_parallel_size=2) as llm:
        assert llm.runner.kv.local.data.shape[-2] == 1  # 2 KV heads: one per rank
        _check(llm, tiny_model, prompts)


def test_tp2_qwen2_biases_and_tied_embeddings_match_transformers(model_dirs):
    d = model_dirs["qwen2"]
    with LLM(str(d), block_size=8, max_prefill_chunk=11, tensor_parallel_size=2) as llm:
        _check(llm, d, [prompt(n, seed=n) for n in (3, 11, 29)])


@pytest.mark.parametrize(("block_size", "chunk"), [(16, 9), (4, 32)])
def test_tp3_nine_heads_over_three_kv_heads_matches_transformers(model_9h, block_size, chunk):
    prompts = [prompt(n, seed=n) for n in (2, chunk, chunk + 3, 50)]
    with LLM(str(model_9h), block_size=block_size, max_prefill_chunk=chunk,
             tensor_parallel_size=3) as llm:
        kv = llm.runner.kv.local.data  # [L, 2, blocks, block, KVH, D]: rank 0 holds 1 head
        assert kv.shape[-2:] == (1, 8)
        _check(llm, model_9h, prompts)
        ranks = list(llm._tp.procs)
    # leaving the block stopped the ranks cleanly: they left serve_rank on STOP (exit 0,
    # not killed) and none is left running
    assert [p.returncode for p in ranks] == [0, 0]
    assert not {c.pid for c in psutil.Process().children(recursive=True)} & {
        p.pid for p in ranks}


def test_tp_kv_export_and_import_carry_every_head(tiny_model):
    """Rank 0 exports whole-head KV (gathered from the ranks) equal to a TP = 1 engine's,
    and an import scatters each rank its heads (read back through the export)."""
    p = prompt(21, seed=5)
    params = dataclasses.replace(GREEDY, max_tokens=4)
    ref = LLM(str(tiny_model), block_size=8)
    req = ref.add_request(p, params, "r")
    ref.step()  # the whole prompt in one step
    ref_kv = ref.runner.kv.export_tokens(req.block_ids, 0, 21)  # [L, 2, T, KVH, D]
    with LLM(str(tiny_model), block_size=8, tensor_parallel_size=2) as llm:
        req = llm.add_request(p, params, "r")
        llm.step()
        kv = llm.runner.kv.export_tokens(req.block_ids, 0, 21)
        assert kv.shape == ref_kv.shape == (2, 2, 21, 2, 16)
        torch.testing.assert_close(kv, ref_kv, rtol=1e-5, atol=1e-5)
        llm.runner.kv.import_tokens(req.block_ids, 0, ref_kv * 2)
        torch.testing.assert_close(llm.runner.kv.export_tokens(req.block_ids, 0, 21),
                                   ref_kv * 2)
        llm.abort("r")
        assert llm.block_manager.num_used_blocks == 0


def test_a_dead_rank_fails_the_next_step_with_its_name_and_shutdown_reaps_it(tiny_model):
    from engine.parallel.state import TPGroupError, current_group

    llm = LLM(str(tiny_model), block_size=8, tensor_parallel_size=2)
    (child,) = llm._tp.procs
    child.kill()
    child.wait()
    with pytest.raises(TPGroupError, match=rf"rank 1 \(pid {child.pid}\) exited with code -9"):
        llm.generate([prompt(12)], GREEDY)
    with pytest.raises(TPGroupError, match="rank 1"):  # failed for good, at once
        llm.generate([prompt(5)], GREEDY)
    llm.shutdown()
    assert current_group() is None
    for rid in list(llm._requests):  # the failed step's requests: nothing leaks
        llm.abort(rid)
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_a_ranks_weight_bytes_count_only_its_slices(model_9h):
    from engine.memory import weight_bytes
    from engine.parallel.loader import shard_weight_bytes

    cfg = load_model_config(model_9h)
    total = weight_bytes(model_9h, torch.float32)
    ranks = [shard_weight_bytes(cfg, model_9h, Shard.of(cfg, 3, r), torch.float32)
             for r in range(3)]
    loaded = [sum(t.numel() * 4 for _, t in iter_shard(cfg, model_9h, Shard.of(cfg, 3, r),
                                                        "cpu", torch.float32))
              for r in range(3)]
    assert ranks == loaded  # what each rank will hold, read from the headers alone
    assert ranks[0] > ranks[1] == ranks[2]  # rank 0 alone keeps the (untied) LM head
    assert ranks[1] < total / 2
