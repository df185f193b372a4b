"""The emulated model's KV: real bytes of the true shape, a deterministic function of
(the tokens up to a position, layer, K/V, position), cheap to write and to check.

A position's *state* ``h[i]`` chains the tokens (``h[i] = mix(h[i-1] * K + token[i])``,
from ``ROOT`` before position 0), so it stands for "the prompt up to i" as a real model's
KV does: a prefix-cached block holds the same bytes for every request sharing the prefix.
Every (layer, K/V, position) of the cache holds one 64-bit word tiled over its
``kv_heads x head_dim`` elements:

    word(l, kv, i) = h[i] ^ salt(l, kv, i)        salt: a fixed hash of (l, kv, i)

so any one slab gives back ``h[i]`` (``word ^ salt``), and a range received is checked
without the prompt: every word of a slab equal (tiling), every slab of a position giving
the same ``h`` (the layers and K/V agree; a range placed at the wrong position or layer
reads other salts and disagrees). One flipped byte anywhere breaks one of the two.

Words keep bits 14-15 of each 16-bit element clear (``MASK``): a bf16 / fp16 element
then never has an all-ones exponent, so no NaN or Inf lies in the cache (a copy that
canonicalised NaNs would change bits). The emulated model's next token is a hash of the
state (engine/emulate/runner.py): decode reads it off the KV it received.
"""

from __future__ import annotations

import numpy as np
import torch

MASK = 0x3FFF_3FFF_3FFF_3FFF  # bits 14-15 of every 16-bit lane clear
_M64 = (1 << 64) - 1
ROOT = 0x1234_0567_089A_0BCD & MASK  # the state before position 0
_K = 0x9E37_79B9_7F4A_7C15


def mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (64 bits)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return x ^ (x >> 31)


def step(h: int, token: int) -> int:
    """The state after ``token`` at the position after state ``h``."""
    return mix(h * _K + token + 1) & MASK


def chain(h: int, tokens) -> list[int]:
    """States after each of ``tokens`` in turn, starting from state ``h``."""
    out = []
    for t in tokens:
        h = mix(h * _K + t + 1) & MASK
        out.append(h)
    return out


def mix_np(x: np.ndarray) -> np.ndarray:
    """``mix`` over a uint64 array (its products wrap at 64 bits, as ``mix`` masks)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58_476D_1CE4_E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D0_49BB_1331_11EB)
    return x ^ (x >> np.uint64(31))


def step_np(h: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``step`` over uint64 arrays: the state after ``tokens[i]`` from state ``h[i]``,
    for every ``i`` at once (a decode step's rows: one token each)."""
    with np.errstate(over="ignore"):
        return mix_np(h * np.uint64(_K) + tokens + np.uint64(1)) & np.uint64(MASK)


def salts(num_layers: int, num_positions: int) -> torch.Tensor:
    """``salt(l, kv, i)`` for every layer, K/V and position: int64 ``[L, 2, P]``."""
    lk = np.arange(num_layers * 2, dtype=np.uint64).reshape(num_layers, 2, 1)
    pos = np.arange(num_positions, dtype=np.uint64).reshape(1, 1, num_positions)
    with np.errstate(over="ignore"):
        x = mix_np(lk * np.uint64(0xD6E8_FEB8_6659_FD93) + pos * np.uint64(_K)
                    + np.uint64(0x5851_F42D_4C95_7F2D))
    return torch.from_numpy((x & np.uint64(MASK)).view(np.int64))


class PatternError(ValueError):
    """A KV range that is not what the emulated model wrote there."""


class KVPattern:
    """Writes and checks the pattern in a KV cache of ``[L, 2, slots, KVH, D]`` whose
    ``D`` is a multiple of 4 16-bit elements (or 2 fp32 ones): seen as int64
    ``[L, 2, slots, KVH, Q]``, every slab is one word repeated."""

    def __init__(self, num_layers: int, max_positions: int):
        self.num_layers = num_layers
        self.salt = salts(num_layers, max_positions)  # [L, 2, P] int64
        # numpy views for the per-row paths (no torch dispatch per op): uint64 [L, 2, P],
        # and position-major [P, 2L] (a decode step's words: one gather of rows)
        self._salt_np = self.salt.numpy().view(np.uint64)
        self._salt_rows = np.ascontiguousarray(
            self._salt_np.transpose(2, 0, 1).reshape(max_positions, -1))
        self._base: np.ndarray | None = None  # write_sparse's slab offsets
        self._words: tuple[int, np.ndarray] | None = None  # _flat's last cache

    def _flat(self, slots64: torch.Tensor) -> np.ndarray:
        """The cache's words as one flat uint64 numpy array sharing its memory (the last
        cache's kept: the view costs a few torch calls, and it holds the cache alive, so
        its address names it)."""
        if self._words is None or self._words[0] != slots64.data_ptr() or \
                self._words[1].size != slots64.numel():
            self._words = (slots64.data_ptr(), slots64.view(-1).numpy().view(np.uint64))
        return self._words[1]

    def words(self, states: torch.Tensor, positions: torch.Tensor,
              layers: slice = slice(None)) -> torch.Tensor:
        """int64 ``[L', 2, T]`` of the states ``[T]`` at ``positions`` ``[T]``."""
        return states.view(1, 1, -1) ^ self.salt[layers][:, :, positions]

    def write(self, slots64: torch.Tensor, slots: list[int], states: list[int],
              positions: list[int]) -> None:
        """Write the words of ``states`` at ``positions`` into ``slots64`` (the cache as
        int64 ``[L, 2, S, KVH, Q]``) at ``slots``. A run of consecutive slots (a block's
        tokens) is one broadcast copy into its slice: one pass over the bytes written."""
        if not states:
            return
        w = self.words(torch.tensor(states, dtype=torch.int64),
                       torch.tensor(positions, dtype=torch.long))  # [L, 2, T]
        tiles = w[:, :, :, None, None]  # [L, 2, T, 1, 1], broadcast over [KVH, Q]
        for i, j in slot_runs(slots):
            slots64[:, :, slots[i]:slots[j - 1] + 1] = tiles[:, :, i:j]

    def write_sparse(self, slots64: torch.Tensor, slots: np.ndarray, states: np.ndarray,
                     positions: np.ndarray) -> None:
        """Only the first word of each slab of ``states`` (uint64 ``[T]``) at ``positions``
        into ``slots`` (int64 ``[T]``): what a later step reads back (decode tokens, see
        the runner). One scatter of ``T x L x 2`` words; the cache must be contiguous."""
        L, _, S, H, Q = slots64.shape
        if self._base is None or self._base.shape[0] != L * 2 or self._base[1] != S * H * Q:
            self._base = np.arange(L * 2, dtype=np.int64) * (S * H * Q)  # (l, kv)'s slab 0
        flat = (slots[:, None] * (H * Q) + self._base).ravel()  # [T x 2L]
        self._flat(slots64)[flat] = (states[:, None] ^ self._salt_rows[positions]).ravel()

    def states_at(self, slots64: torch.Tensor, slots: np.ndarray, positions: np.ndarray
                  ) -> np.ndarray:
        """uint64 ``[T]``: the states at ``positions`` read off the cache at ``slots``
        (int64 ``[T]``; layer 0, K, each slab's first word: one gather of T words)."""
        H, Q = slots64.shape[3:]
        return self._flat(slots64)[slots * (H * Q)] ^ self._salt_np[0, 0, positions]

    def state_at(self, slots64: torch.Tensor, slots: list[int], positions: list[int]
                 ) -> list[int]:
        """``states_at`` on lists."""
        if not slots:
            return []
        return self.states_at(slots64, np.array(slots, dtype=np.int64),
                              np.array(positions, dtype=np.int64)).tolist()

    def check(self, payload: torch.Tensor, start: int, layer_start: int = 0) -> None:
        """PatternError naming the first wrong position of ``payload`` ``[L', 2, T, H', D]``
        (the KV of positions [start, start + T), layers [layer_start, +L'))."""
        v = as_words(payload)  # [L', 2, T, H', Q]
        L, _, T = v.shape[:3]
        if layer_start + L > self.num_layers or start + T > self.salt.shape[2]:
            raise PatternError(f"KV range layers [{layer_start}, {layer_start + L}) x "
                               f"positions [{start}, {start + T}) is outside the model")
        first = v[..., :1, :1]  # [L', 2, T, 1, 1]
        h = first[..., 0, 0] ^ self.salt[layer_start:layer_start + L, :, start:start + T]
        if torch.equal(v, first.expand_as(v)) and torch.equal(h, h[:1, :1].expand_as(h)):
            return  # every slab one word tiled, and every slab of a position one state
        bad = (v != first).flatten(3).any(dim=3)  # [L', 2, T]: a slab not one word tiled
        bad |= h != h[:1, :1]  # layers and K/V disagree on the position's state
        if bool(bad.any()):
            ls, kv, t = (int(x) for x in bad.nonzero()[0])
            raise PatternError(
                f"emulated KV check failed at position {start + t}, layer {layer_start + ls} "
                f"{'KV'[kv]}: the bytes received are not the KV the prefill wrote for that "
                f"position (corrupted or misplaced in transfer)")


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """``[i, j)`` index ranges of ``slots`` whose slots are consecutive (a block's tokens):
    each one slice of the cache, one copy."""
    runs, i = [], 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[..., D]`` (16- or 32-bit elements) as int64 ``[..., D * size / 8]``."""
    if not t.is_contiguous() or t.storage_offset() * t.element_size() % 8:
        t = t.contiguous().clone()
    return t.view(torch.int64)
