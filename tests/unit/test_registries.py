"""Registries are the one source of names (docs/design.md §9).

Each test adds a part from this module alone (a connector, a send policy, a fairness and
a chunk policy, an attention backend, a model architecture), then selects it by name
through the real `pdserve serve` parser and the configs, and runs it: no other file
names it. A name nobody registered is refused by the parser and the config alike.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil

import pytest
import torch

from cluster.cli import build_parser, main
from cluster.config.flags import config_from_args
from cluster.config.serve import ServeConfig
from engine.registry import Registry, load_ref


@contextlib.contextmanager
def registered(registry: Registry, name: str, item, help: str = ""):
    registry.register(name, item, help=help)
    try:
        yield item
    finally:
        registry.unregister(name)


def serve_config(*flags: str) -> ServeConfig:
    """The config `pdserve serve FLAGS...` would run with."""
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def serve_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    return capsys.readouterr().out


# ---- the helper itself -------------------------------------------------------------------
def test_registry_lists_names_in_order_and_names_them_in_errors():
    reg: Registry[int] = Registry("widget")
    reg.register("alpha", 1, help="the first")
    reg.register("beta", 2)
    assert reg.names() == ("alpha", "beta") and list(reg) == ["alpha", "beta"]
    assert "alpha" in reg and "gamma" not in reg and None not in reg and len(reg) == 2
    assert reg.get("beta") == 2 and reg.help("alpha") == "the first"
    assert reg.describe() == "alpha (the first), beta"
    with pytest.raises(ValueError, match=r"unknown widget 'alpah'; known: \['alpha', 'beta'\]; "
                       r"did you mean 'alpha'\?"):
        reg.get("alpah")
    with pytest.raises(ValueError, match="'alpha' is already registered"):
        reg.register("alpha", 3)
    reg.register("alpha", 3, replace=True)
    assert reg.get("alpha") == 3
    reg.unregister("alpha")
    with pytest.raises(ValueError, match=r"unknown widget 'alpha'; known: \['beta'\]"):
        reg.unregister("alpha")
    for bad in ("", " padded ", None):
        with pytest.raises(ValueError, match="names must be non-empty strings"):
            reg.register(bad, 0)  # type: ignore[arg-type]


def test_references_are_imported_on_first_use_only():
    assert load_ref("json:dumps") is json.dumps
    assert load_ref(json.dumps) is json.dumps  # not a reference: as is
    with pytest.raises(ValueError, match="package.module:attr"):
        load_ref("json.dumps")
    with pytest.raises(ModuleNotFoundError):
        load_ref("no_such_module_anywhere:thing")


# ---- connector -------------------------------------------------------------------------
def test_a_connector_registered_here_is_a_serve_flag_and_carries_kv(capsys):
    from kv_transfer import TransferConfig, make_receiver, make_sender
    from kv_transfer.inproc import make_inproc_receiver, make_inproc_sender
    from kv_transfer.registry import CONNECTORS, register_connector
    from kv_transfer.testing import PagedKV, make_chunks, pump

    built = []

    def sender(cfg, **kw):
        built.append(("sender", cfg.connector))
        return make_inproc_sender(cfg, **kw)

    def receiver(cfg, **kw):
        built.append(("receiver", cfg.connector))
        return make_inproc_receiver(cfg, **kw)

    with pytest.raises(SystemExit):  # not registered yet: argparse refuses it
        serve_config("--connector", "relay")
    assert "invalid choice: 'relay'" in capsys.readouterr().err
    register_connector("relay", sender, receiver, help="in-process relay (test)")
    try:
        cfg = serve_config("--connector", "relay")
        assert cfg.transfer.connector == "relay"
        # wherever argparse wraps the connectors' list
        assert "relay (in-process relay (test))" in " ".join(serve_help(capsys).split())
        tcfg = TransferConfig(connector=cfg.transfer.connector)
        shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
                 "num_blocks": 16}
        src, dst = PagedKV(**shape), PagedKV(**shape)
        for kv in (src, dst):
            kv.allocate("r", 10)
        src.fill_random("r", 10, seed=1)
        rx, tx = make_receiver(tcfg), make_sender(tcfg)
        try:
            for chunk in make_chunks(src, "r", [0, 4, 10]):
                tx.send(chunk, dest=rx.endpoint)
            assert pump(tx, rx, dst, ["r"]) == ({}, {})
            assert torch.equal(dst.export("r", 0, 10), src.export("r", 0, 10))
        finally:
            tx.close()
            rx.close()
        assert built == [("receiver", "relay"), ("sender", "relay")]
    finally:
        CONNECTORS.unregister("relay")
    with pytest.raises(ValueError, match="transfer.connector must be one of"):
        ServeConfig().with_values({"transfer.connector": "relay"})


# ---- send policy -------------------------------------------------------------------------
def test_a_send_policy_registered_here_is_a_serve_flag_and_paces_the_link():
    from kv_transfer import TransferConfig
    from kv_transfer.link_scheduler import LinkScheduler
    from kv_transfer.pacing import SEND_POLICIES, SendPolicy, TokenBucket, register_send_policy
    from kv_transfer.send_queue import QueuedFrame

    half = SendPolicy("half-rate", False,
                      lambda cfg: TokenBucket(cfg.rate_bytes_per_s / 2, cfg.burst_bytes),
                      help="paced at half of rate_gbps (test)", needs_rate=True)
    register_send_policy(half)
    try:
        cfg = serve_config("--send-policy", "half-rate", "--rate-gbps", "8")
        assert cfg.transfer.send_policy == "half-rate"
        with pytest.raises(ValueError, match="transfer.rate_gbps must be set when send_policy "
                           "is 'half-rate'"):
            serve_config("--send-policy", "half-rate")
        tcfg = TransferConfig(send_policy=cfg.transfer.send_policy,
                              rate_bytes_per_s=cfg.transfer.rate_gbps * 1e9 / 8,
                              burst_bytes=1 << 20, max_frame_bytes=1 << 20,
                              credit_window_bytes=8 << 20)
        link = LinkScheduler(tcfg)
        for i in range(2):
            link.enqueue(QueuedFrame("r", "t", 1 << 20, 0.0), completes_request=i == 1)
        sent, _ = link.next_batch(0.0)  # the full bucket lets one burst go
        assert len(sent) == 1
        sent, wait = link.next_batch(0.0)
        assert sent == [] and wait == pytest.approx((1 << 20) / 0.5e9)  # half of 1 GB/s
    finally:
        SEND_POLICIES.unregister("half-rate")


# ---- fairness and chunk policies ---------------------------------------------------------
def test_fairness_and_chunk_policies_registered_here_drive_the_prefill_scheduler():
    from engine.block_manager import BlockManager
    from engine.request import Request, RequestStatus, SamplingParams
    from prefill_worker.policies import CHUNK_POLICIES, FAIRNESS_POLICIES, ChunkPolicy
    from prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig

    class QuarterChunks(ChunkPolicy):
        def size(self, remaining: int, budget: int) -> int:
            return max(0, min(remaining, self.max_chunk // 4, budget))

    with registered(FAIRNESS_POLICIES, "longest-first",
                    lambda r, now, served: (-r.remaining, r.arrival), "most tokens left"), \
            registered(CHUNK_POLICIES, "quarter", QuarterChunks, "a quarter of the cap"):
        cfg = serve_config("--fairness-policy", "longest-first", "--chunk-policy", "quarter",
                           "--max-prefill-chunk", "32", "--max-num-batched-tokens", "8")
        s = cfg.scheduler
        sched = PrefillScheduler(PrefillSchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens, max_prefill_chunk=s.max_prefill_chunk,
            fairness_policy=s.fairness_policy, chunk_policy=s.chunk_policy), BlockManager(32, 4))
        reqs = [Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0))
                for rid, n in (("short", 12), ("long", 40))]
        for r in reqs:
            sched.add(r)
        items = sched.schedule()
        assert [(i.request.request_id, i.num_tokens) for i in items] == [("long", 8)]
        while sched.has_work:
            items = sched.schedule()
            sched.advance(items)
            for i in items:
                if i.request.remaining_prefill == 0:
                    sched.finish(i.request, RequestStatus.FINISHED_STOPPED)
        assert sched.bm.num_free_blocks == sched.bm.num_blocks
        sched.bm.check_integrity()
    with pytest.raises(ValueError, match="scheduler.fairness_policy must be one of"):
        ServeConfig().with_values({"scheduler.fairness_policy": "longest-first"})
    with pytest.raises(ValueError, match="unknown chunk_policy 'quarter'"):
        PrefillSchedulerConfig(chunk_policy="quarter")


# ---- attention backend -----------------------------------------------------------------
def test_an_attention_backend_registered_here_runs_the_engine(tiny_model):
    from engine import LLM, SamplingParams
    from engine.attention import ATTENTION_BACKENDS, AttentionBackend, get_backend

    calls = {"prefill": 0, "decode": 0}

    def counting(device):
        ref = get_backend("torch", device)

        def prefill(*a, **kw):
            calls["prefill"] += 1
            return ref.paged_prefill_attention(*a, **kw)

        def decode(*a, **kw):
            calls["decode"] += 1
            return ref.paged_decode_attention(*a, **kw)

        return AttentionBackend("counting", prefill, decode, ref.write_kv)

    with registered(ATTENTION_BACKENDS, "counting", counting, "torch, counted (test)"):
        cfg = serve_config("--attention-backend", "counting")
        assert cfg.model.attention_backend == "counting"
        params = SamplingParams(temperature=0, max_tokens=6)
        prompt = list(range(3, 40))
        got = LLM(str(tiny_model), attention_backend=cfg.model.attention_backend,
                  num_blocks=64).generate(prompt, params)[0].token_ids
        want = LLM(str(tiny_model), attention_backend="torch",
                   num_blocks=64).generate(prompt, params)[0].token_ids
    assert got == want and len(got) == 6
    assert calls["prefill"] > 0 and calls["decode"] > 0


# ---- model architecture -------------------------------------------------------------------
def test_a_model_architecture_registered_here_is_loaded_and_served(tiny_model, tmp_path):
    from engine import LLM, SamplingParams
    from engine.loader import ModelLoadError, load_model_config
    from engine.models.llama import LlamaForCausalLM
    from engine.models.registry import MODELS, ModelArch, register_model

    forwards = []

    class CountingLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            forwards.append(args[0].shape[0])
            return super().forward(*args, **kwargs)

    model_dir = tmp_path / "counting"
    shutil.copytree(tiny_model, model_dir)
    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["architectures"] = ["CountingLlamaForCausalLM"]
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="not supported; supported: .*LlamaForCausalLM"):
        load_model_config(model_dir)

    register_model("CountingLlamaForCausalLM", ModelArch(CountingLlama))
    try:
        cfg = serve_config("--model", str(model_dir))
        assert load_model_config(cfg.model.path).architecture == "CountingLlamaForCausalLM"
        params = SamplingParams(temperature=0, max_tokens=5)
        prompt = [random.Random(3).randrange(1, 200) for _ in range(21)]
        llm = LLM(cfg.model.path, num_blocks=64)
        assert isinstance(llm.runner.model, CountingLlama)
        got = llm.generate(prompt, params)[0].token_ids
        want = LLM(str(tiny_model), num_blocks=64).generate(prompt, params)[0].token_ids
    finally:
        MODELS.unregister("CountingLlamaForCausalLM")
    assert got == want and forwards and sum(forwards) >= len(prompt) + 4
