"""Frozen, layered engine configuration. Derived values are properties; never mutate
a config after creation (use `dataclasses.replace`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# The one list of dtype names: weights, KV cache, the config's choices and the KV wire.
DTYPES = ("float32", "float16", "bfloat16")
# The one list of compiled-step modes (engine.compile says what each does; kept here, in
# a torch-free module, so the CLI's choices come from it without loading torch).
COMPILE_MODES = ("auto", "none", "decode", "all", "prefill")


def torch_dtype(name: str):
    """The torch dtype of a DTYPES name (torch imported lazily: configs stay light)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts read from an HF `config.json` (see engine.loader)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_inv_freq: tuple[float, ...] = field(default=(), repr=False)
    rope_attention_scaling: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        # (the architecture is checked against engine.models.registry by the loader, which
        # sits above this module)
        if not self.architecture:
            raise ValueError("ModelConfig.architecture must be an HF architecture name")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one token over all layers, in fp32 (scale by element size)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


# ---- tensor parallelism: which slice of the model one rank holds (Megatron layout) ----
# Rank r of N holds query heads [r * H/N, (r+1) * H/N) and the KV heads they read:
#
#     KVH >= N (KVH % N == 0): KV heads [r * KVH/N, (r+1) * KVH/N), each held by one rank
#     KVH <  N (N % KVH == 0): one KV head, r * KVH // N, held by N/KVH ranks (replicated)
#
#     H = 8, KVH = 2, N = 4:  rank     0    1    2    3
#                             q heads  0-1  2-3  4-5  6-7
#                             KV head  0    0    1    1
#
# and MLP rows [r * I/N, (r+1) * I/N) of gate/up (columns of down). q/k/v and gate/up are
# column-parallel (split along their outputs), o_proj and down_proj row-parallel (split
# along their inputs; their partial sums are all-reduced). Norms, the embedding and the
# LM head are replicated: see engine/parallel/README.md for why.


def check_tp(model: ModelConfig, size: int) -> None:
    """ValueError naming the numbers when `size` ranks cannot split `model`."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    h, kvh, inter = model.num_heads, model.num_kv_heads, model.intermediate_size
    if h % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"num_attention_heads={h}")
    if kvh >= size and kvh % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"num_key_value_heads={kvh}")
    if kvh < size and size % kvh:
        raise ValueError(f"tensor_parallel_size={size} is larger than num_key_value_heads="
                         f"{kvh} and not a multiple of it (KV heads are replicated only "
                         "evenly)")
    if inter % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"intermediate_size={inter}")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the head, KV-head and MLP ranges it holds."""

    rank: int
    size: int
    num_heads: int  # the whole model's
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    @classmethod
    def of(cls, model: ModelConfig, size: int = 1, rank: int = 0) -> Shard:
        check_tp(model, size)
        return cls(rank, size, model.num_heads, model.num_kv_heads, model.intermediate_size)

    @property
    def heads(self) -> tuple[int, int]:
        """[start, end) of this rank's query heads."""
        n = self.num_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_heads(self) -> tuple[int, int]:
        """[start, end) of this rank's KV heads (one head, shared, when KVH < size)."""
        if self.num_kv_heads < self.size:
            head = self.rank * self.num_kv_heads // self.size
            return head, head + 1
        n = self.num_kv_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_owner(self) -> bool:
        """The first rank holding its KV heads (the one whose copy a gather keeps)."""
        if self.rank == 0:
            return True
        return replace(self, rank=self.rank - 1).kv_heads != self.kv_heads  # ranges ascend

    @property
    def mlp(self) -> tuple[int, int]:
        """[start, end) of this rank's MLP rows (gate/up outputs, down inputs)."""
        n = self.intermediate_size // self.size
        return self.rank * n, (self.rank + 1) * n

    def local_config(self, model: ModelConfig) -> ModelConfig:
        """`model` as this rank sees it: its heads, KV heads and MLP width. Ranks other
        than 0 never compute logits, so they keep no LM head of their own (tied to the
        embedding they need anyway)."""
        if self.size == 1:
            return model
        return replace(
            model,
            num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.mlp[1] - self.mlp[0],
            tie_word_embeddings=model.tie_word_embeddings or self.rank > 0,
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized by engine.memory.num_kv_blocks
    kv_cache_memory_bytes: int = 1 << 30  # on CPU devices (GPUs size from their memory)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # of a GPU's memory: weights + KV + activations
    gpu_share: float = 1.0  # this engine's share of its GPU (< 1 when workers share one)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.gpu_share <= 1:
            raise ValueError(f"gpu_share must be in (0, 1], got {self.gpu_share}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_prefill_chunk: int | None = None  # None: limited by the token budget only
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be >= 1 or None")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    @property
    def chunk_cap(self) -> int:
        """Largest chunk a single prefill may take in one step."""
        cap = self.max_num_batched_tokens
        if self.max_prefill_chunk is not None:
            cap = min(cap, self.max_prefill_chunk)
        return cap


@dataclass(frozen=True)
class EmulateConfig:
    """The emulated accelerator (engine/emulate/): steps take the time the cost model
    (engine/costs/) gives, on real KV bytes of the model's shape. ``costs``: an analytic
    profile (engine.costs.analytic PROFILES: "h200", "h100", "a100") or a calibration
    file (``*.json``); ``shape``: the model shape it runs (analytic SHAPES)."""

    costs: str
    shape: str
    # the share of each chunk's KV layers a prefill worker sends (where this host cannot
    # move bytes as fast as the emulated link: the link is charged the full size)
    kv_fraction: float = 1.0
    # every device time (steps, copies) this many times the cost model's: a study on a
    # host too slow for the device (its KV copies would set the pace) runs the device and,
    # by its own setting, the link that much slower; shares and ratios then hold for a
    # host that much faster than this one (tools/layerwise_bench.py --time-scale)
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        from engine.costs.analytic import PROFILES, SHAPES  # (numpy: loaded only when asked)

        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"emulate: kv_fraction must be in (0, 1], got {self.kv_fraction}")
        if not (math.isfinite(self.time_scale) and self.time_scale >= 1):
            raise ValueError(f"emulate: time_scale must be >= 1, got {self.time_scale}")

        if self.costs not in PROFILES and not self.costs.endswith(".json"):
            raise ValueError(f"emulate: {self.costs!r} is neither an analytic profile "
                             f"({', '.join(sorted(PROFILES))}) nor a calibration file (.json)")
        if self.shape not in SHAPES:
            raise ValueError(f"emulate: unknown model shape {self.shape!r}; known: "
                             f"{', '.join(sorted(SHAPES))}")

    @property
    def label(self) -> str:
        """What every output says about figures of this device."""
        sent = "" if self.kv_fraction == 1 else \
            f" (KV sent: {self.kv_fraction:g} of each chunk's bytes, the link charged in full)"
        if self.time_scale != 1:
            sent += f" (time x{self.time_scale:g}: every device time {self.time_scale:g} times)"
        if self.costs.endswith(".json"):
            return (f"emulated {self.costs.rsplit('/', 1)[-1]}, {self.shape}: calibration "
                    f"file{sent}")
        return f"emulated {self.costs}, {self.shape}: analytic, not measured{sent}"

    def layers_sent(self, num_layers: int) -> int:
        """KV layers of a chunk a prefill worker sends: [0, this) (at least one)."""
        return max(1, math.ceil(self.kv_fraction * num_layers - 1e-9))


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    seed: int = 0
    compile: str = "auto"  # compiled model step (engine.compile): COMPILE_MODES
    tensor_parallel_size: int = 1  # ranks of one engine (engine.parallel), vLLM's name
    emulate: EmulateConfig | None = None  # an emulated accelerator (engine/emulate/)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        check_tp(self.model, self.tensor_parallel_size)  # heads, KV heads, MLP divide
