"""The compiled model step (engine/compile.py): greedy outputs equal transformers' (fp32)
over chunk and block sizes, the steps of each mode really run compiled, a compiler that
fails (a broken C++ toolchain, a step that raises) leaves a logged reason and an engine
that serves eagerly, padding rows write no KV, and RMSNorm is one op bit-equal to
transformers'. Tiny models and few graph shapes keep it quick (one compile per
architecture and token-count class, reused by every engine of the process); the 0.5B
shape and the real weights are `slow`."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.compile import decode_buckets, resolve_mode
from engine.config import COMPILE_MODES
from tests.unit.test_engine_exactness import hf_greedy, prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _counting(llm: LLM) -> dict[str, int]:
    """Count compiled and eager forwards of `llm` from now on."""
    calls = {"compiled": 0, "steps": 0}
    run, step = llm.runner.compiled.run, llm.runner.run  # run(): the runner's one entry

    def counted_run(*a, **kw):
        calls["compiled"] += 1
        return run(*a, **kw)

    def counted_step(chunks):
        calls["steps"] += 1
        return step(chunks)

    llm.runner.compiled.run = counted_run
    llm.runner.run = counted_step
    return calls


@pytest.mark.parametrize("chunk,block_size", [(1, 16), (7, 8), (16, 1), (33, 16)])
def test_compiled_greedy_matches_transformers(tiny_model, chunk, block_size):
    llm = LLM(str(tiny_model), compile="all", block_size=block_size, max_prefill_chunk=chunk,
              max_num_batched_tokens=64)
    assert llm.runner.compiled.mode == "all", llm.runner.compiled.report.line()
    calls = _counting(llm)
    lengths = sorted({max(1, chunk - 1), chunk + 1, 3 * chunk + 5})
    prompts = [prompt(n, seed=n) for n in lengths]
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens), f"prompt len {len(p)}"
    assert calls["compiled"] == calls["steps"] > 0  # every step ran the compiled forward
    assert llm.runner.compiled.mode == "all"  # no fallback on the way
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


@pytest.mark.parametrize("arch", [pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_compiled_other_architectures_match_transformers(model_dirs, arch):
    d = model_dirs[arch]  # qkv bias (qwen2), q/k norms (qwen3): other graphs (one compile each)
    llm = LLM(str(d), compile="all", block_size=8, max_prefill_chunk=7)
    prompts = [prompt(n, seed=n) for n in (6, 23)]
    for p, o in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(d, p, GREEDY.max_tokens)
    assert llm.runner.compiled.mode == "all"
    assert llm.block_manager.num_used_blocks == 0


def test_decode_batches_padded_to_buckets_match_transformers(tiny_model, monkeypatch):
    """The CUDA-graph layout on the CPU: decode batches padded to their bucket (rows that
    write no KV), block tables padded to one width, read from a buffer that never moves."""
    from engine import compile as compile_mod

    monkeypatch.setattr(compile_mod, "PADDED_DECODE", {"cpu", "cuda"})
    llm = LLM(str(tiny_model), compile="decode", max_num_seqs=20, max_prefill_chunk=64,
              block_size=8)
    compiled = llm.runner.compiled
    assert compiled.padded and compiled.buckets == (1, 2, 4, 8, 16, 24)
    rows: list[int] = []
    run = compiled.run

    def spy(fn, ids, pos):
        rows.append(len(ids))
        return run(fn, ids, pos)

    compiled.run = spy
    prompts = [prompt(n, seed=n) for n in (3, 9, 17, 30, 41)]  # 5 decodes pad to 8
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens), f"prompt len {len(p)}"
    assert 8 in rows and set(rows) <= set(compiled.buckets)
    assert llm.runner._graph_buf.fixed and llm.block_manager.num_used_blocks == 0


def test_padded_decode_steps_carry_logprobs_and_prompt_logprobs(tiny_model, monkeypatch):
    """Log-probs with the CUDA-graph layout on the CPU: one-token prompt chunks (which run
    as decode rows) ask for every row's logits; padding rows follow the real ones, so the
    sampled rows and the prompt rows are transformers' (fp32) in padded steps too."""
    from dataclasses import replace

    from engine import compile as compile_mod
    from tests.logprobs_ref import check_entry, check_prompt, hf_logprobs

    monkeypatch.setattr(compile_mod, "PADDED_DECODE", {"cpu", "cuda"})
    llm = LLM(str(tiny_model), compile="decode", max_num_seqs=4, max_prefill_chunk=1,
              block_size=4)
    calls, rows = _counting(llm), []
    run = llm.runner.compiled.run

    def spy(fn, ids, pos):
        rows.append(len(ids))
        return run(fn, ids, pos)

    llm.runner.compiled.run = spy
    prompts = [prompt(n, seed=n) for n in (5, 9, 2)]  # 3 rows pad to 4
    params = [replace(GREEDY, logprobs=2, prompt_logprobs=3), GREEDY,
              replace(GREEDY, logprobs=1, prompt_logprobs=0)]
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens), f"prompt len {len(p)}"
    for o, n, pn in ((outs[0], 2, 3), (outs[2], 1, 0)):
        ref = hf_logprobs(tiny_model, o.prompt_token_ids + o.token_ids)
        check_prompt(o.prompt_logprobs, ref, o.prompt_token_ids, pn)
        start = len(o.prompt_token_ids) - 1
        for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            check_entry(lp, ref[start + i], tok, n)
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    assert calls["compiled"] == calls["steps"] > 0 and 4 in rows  # all padded, compiled
    assert llm.runner.compiled.mode == "decode" and llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_decode_mode_compiles_decode_steps_only(tiny_model):
    llm = LLM(str(tiny_model), compile="decode", max_prefill_chunk=16)
    calls = _counting(llm)
    p = prompt(40, seed=4)  # three prefill steps, then decode steps
    out = llm.generate([p], GREEDY)[0]
    assert out.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)
    assert calls["steps"] == 3 + GREEDY.max_tokens - 1
    assert calls["compiled"] == GREEDY.max_tokens - 1
    none = LLM(str(tiny_model), compile="none")
    assert none.runner.compiled.forward_for(True) is None
    assert none.runner.compiled.report.line() == "compiled step off (requested none)"


def test_a_failing_compiled_step_falls_back_to_eager_and_says_why(tiny_model, monkeypatch,
                                                                 caplog):
    from engine import compile_ops

    llm = LLM(str(tiny_model), compile="all", max_prefill_chunk=16)
    assert llm.runner.compiled.mode == "all"

    def broken(*args, **kwargs):
        raise RuntimeError("injected kernel fault")

    monkeypatch.setattr(compile_ops, "attend", broken)  # only the compiled op's path
    p = prompt(21, seed=2)
    with caplog.at_level(logging.WARNING, logger="engine.compile"):
        out = llm.generate([p], GREEDY)[0]
    assert out.token_ids == hf_greedy(tiny_model, p, GREEDY.max_tokens)  # eager took over
    rep = llm.runner.compiled.report
    assert rep.mode == "none" and rep.fallback_reason == "RuntimeError: injected kernel fault"
    assert "compiled step off (requested all): RuntimeError: injected kernel fault" in caplog.text
    assert llm.block_manager.num_used_blocks == 0


def test_a_broken_cpp_toolchain_falls_back_at_startup(tiny_model, monkeypatch, tmp_path,
                                                      caplog):
    """A real compiler failure: no cached artefacts and a C++ compiler that does not exist."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # (inductor's own patch: a monkeypatch of the config module's attribute deletes the
    # key on undo, and every later compile in the process then fails)
    no_cxx = inductor_config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))})
    torch._dynamo.reset()  # forget the graphs other tests compiled in this process
    try:
        with no_cxx, caplog.at_level(logging.WARNING, logger="engine.compile"):
            llm = LLM(str(tiny_model), compile="decode")
        rep = llm.runner.compiled.report
        assert rep.mode == "none" and rep.fallback_reason
        assert "compiled step off (requested decode)" in caplog.text
        p = prompt(9, seed=9)
        assert llm.generate([p], GREEDY)[0].token_ids == hf_greedy(tiny_model, p, 8)
    finally:
        torch._dynamo.reset()  # later tests compile with the real toolchain


def test_padding_rows_write_no_kv():
    from engine.attention import torch_ref

    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 3)
    torch_ref.write_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, -1]))
    assert k_cache.view(-1, 3)[5].eq(1).all() and v_cache.view(-1, 3)[5].eq(2).all()
    assert k_cache.sum() == 3 and v_cache.sum() == 6  # nothing else written


def test_modes_and_buckets():
    from dataclasses import fields

    from cluster.config.serve import ModelSection
    from engine.config import EngineConfig

    key = next(f for f in fields(ModelSection) if f.name == "compile")
    assert key.metadata["choices"] is COMPILE_MODES  # one list, from the engine
    assert resolve_mode("auto", torch.device("cuda", 0)) == "decode"
    assert resolve_mode("none", torch.device("cpu")) == "none"
    with pytest.raises(ValueError, match="compile must be one of"):
        resolve_mode("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="compile must be one of"):
        EngineConfig(model_dir="x", model=None, compile="fast")  # type: ignore[arg-type]
    assert decode_buckets(1) == (1,)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert decode_buckets(256)[-1] == 256 and decode_buckets(300)[-1] == 300


def test_the_compile_key_reaches_the_workers_engine_config(tiny_model):
    from cluster.config.serve import ServeConfig
    from cluster.launch.worker_specs import engine_config

    cfg = ServeConfig().with_values({"model.compile": "decode"})
    assert cfg.model.compile == "decode"
    with pytest.raises(ValueError, match="model.compile must be one of"):
        ServeConfig().with_values({"model.compile": "fast"})
    for role in ("decode", "colocated"):
        assert engine_config(cfg, str(tiny_model), role).compile == "decode"
    assert engine_config(cfg, str(tiny_model), "prefill").compile == "none"  # no decode steps


def test_the_compile_choices_load_no_torch():
    """`pdserve serve --help` lists the compile modes without importing torch."""
    import subprocess
    import sys

    code = ("import sys\nfrom cluster.cli import main\ntry:\n    main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch loaded'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--compile" in out.stdout and "decode" in out.stdout


def test_rms_norm_is_one_op_and_bit_equal_to_transformers_fp32():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    for dim, rows in ((576, 1), (64, 37), (896, 300)):
        ref = LlamaRMSNorm(dim, eps=1e-5)
        ours = RMSNorm(dim, 1e-5)
        w = torch.randn(dim, generator=g)
        ref.weight.data.copy_(w)
        ours.weight.data.copy_(w)
        x = 3 * torch.randn(rows, dim, generator=g)
        assert torch.equal(ours(x), ref(x)), (dim, rows)
        xb = x.bfloat16()  # other dtypes: transformers' roundings, not one fused op
        assert torch.equal(ours.bfloat16()(xb), ref.bfloat16()(xb))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_decode_step_skips_cleanly_without_cuda(tmp_path, capsys):
    import json

    from tools import gpu_decode_step
    from tools.gpu_check_plan import PLAN

    out = tmp_path / "decode.json"
    assert gpu_decode_step.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"skipped": gpu_decode_step.NO_CUDA}
    assert "no CUDA device" in capsys.readouterr().err
    sweep = next(s for s in PLAN if s.fn == "tools.gpu_decode_step:gpu_check_step")
    assert sweep.needs_cuda  # gpu_check skips it without CUDA


@pytest.mark.slow
def test_compiled_qwen2_05b_shape_matches_transformers():
    """The 0.5B shape (24 layers, hidden 896, 14/2 heads, random weights): a short check,
    slow on CPU (2 GB of fp32 weights; one cold compile)."""
    from engine.tiny_model import ensure_model

    d = ensure_model("qwen2-0.5b-shape", "qwen2")
    llm = LLM(str(d), compile="all", max_prefill_chunk=16, num_blocks=64)
    p = prompt(37, seed=5)
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(d, p, 4)
    assert llm.runner.compiled.mode == "all"


@pytest.mark.slow
@pytest.mark.parametrize("chunk,block_size", [(16, 16), (37, 8), (512, 16)])
def test_compiled_real_weights_match_transformers(chunk, block_size):
    from engine.model_fetch import ModelFetchError, ensure_real_model
    from tests.unit.test_real_model import KV_TOKENS
    from tests.unit.test_real_model import hf_greedy as hf_real

    try:
        d = ensure_real_model("smollm2")
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 real-weights test skipped: {e}")
    llm = LLM(str(d), compile="all", block_size=block_size, max_prefill_chunk=chunk,
              max_num_batched_tokens=max(512, chunk), num_blocks=KV_TOKENS // block_size)
    ps = [prompt(n, seed=n) for n in (11, 230)]  # one and many chunks
    for p, o in zip(ps, llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=10)),
                    strict=True):
        assert o.token_ids == hf_real(str(d), tuple(p)), f"prompt of {len(p)} tokens"
    assert llm.runner.compiled.mode == "all"
    assert llm.block_manager.num_used_blocks == 0
