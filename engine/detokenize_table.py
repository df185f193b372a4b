"""A byte-level BPE tokenizer's detokenization table (engine/detokenize.py reads it):
each id's bytes, checked once against the tokenizer's own decode, and each id's text when
its bytes are whole UTF-8 characters."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


def whole_text(b: bytes) -> str | None:
    """`b`'s text when `push_bytes` would emit it at once with nothing held (valid UTF-8
    not ending in U+FFFD), else None."""
    try:
        text = b.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if not text.endswith(REPLACEMENT) else None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable},
            **{chr(256 + i): b for i, b in enumerate(extra)}}


def byte_level_table(tokenizer: Any, probes: int = 300) -> list[bytes] | None:
    """id -> the bytes its text is made of, for a byte-level BPE tokenizer (GPT-2, Llama 3,
    Qwen, SmolLM) whose decode(ids, skip_special_tokens=True) is the lossy UTF-8 decode of
    those bytes joined; None for any other tokenizer, or when that does not hold for every
    single id and for random sequences of ids (checked here, once)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    byte_of = _byte_decoder()
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    n = backend.get_vocab_size(with_added_tokens=True)
    table = []
    for i in range(n):
        tok = backend.id_to_token(i)
        table.append(b"" if tok is None or i in special else b"".join(
            bytes((byte_of[c],)) if c in byte_of else c.encode() for c in tok))
    import random

    rng = random.Random(0)
    seqs = [[i] for i in range(n)] + [[n + 7]] + [
        [rng.randrange(n) for _ in range(rng.randrange(2, 12))] for _ in range(probes)]
    try:
        got = [b"".join(table[t] if t < n else b"" for t in s).decode("utf-8", "replace")
               for s in seqs]
        if got != backend.decode_batch(seqs, skip_special_tokens=True):
            return None
    except Exception:  # any doubt: the tokenizer's own decode
        return None
    return table
