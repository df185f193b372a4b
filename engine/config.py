"""Frozen, layered engine configuration. Derived values are properties; never mutate
a config after creation (use `dataclasses.replace`)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The one list of dtype names: weights, KV cache, the config's choices and the KV wire.
DTYPES = ("float32", "float16", "bfloat16")
# The one list of compiled-step modes (engine.compile says what each does; kept here, in
# a torch-free module, so the CLI's choices come from it without loading torch).
COMPILE_MODES = ("auto", "none", "decode", "all")


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
class EngineConfig:
    model_dir: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    seed: int = 0
    compile: str = "auto"  # compiled model step (engine.compile): auto, none, decode, all

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
