"""Log-probs in OpenAI's and vLLM's JSON shapes (what the numbers are: engine/logprobs.py).

    completions  choice.logprobs = {tokens, token_logprobs, top_logprobs, text_offset}
                 top_logprobs[i] = {token text: log-prob} of the chosen token and the N
                 most likely (vLLM's: up to N + 1 entries); with echo, the prompt's tokens
                 come first, the first one with null log-prob and top_logprobs.
                 text_offset[i] = characters of the returned text before token i, counted
                 as the sum of the earlier tokens' texts (as vLLM does).
    chat         choice.logprobs = {content: [{token, logprob, bytes, top_logprobs: [{token,
                 logprob, bytes}] (the N most likely, best first)}]}
    vLLM's       prompt_logprobs = [null, {"<token id>": {logprob, rank, decoded_token}},
                 ...]: per prompt token, itself and the N most likely.

A token's text is `tokenizer.decode([id])` (special tokens kept, as vLLM shows them);
`bytes` are the token's own bytes (for byte-level BPE tokenizers the exact ones, so the
bytes of tokens that split a character join into it; otherwise the text's UTF-8). JSON
has no -inf: a log-prob below -9999 (a token outside top-k / top-p) is shown as -9999.0,
as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.logprobs import PromptLogprobs, TokenLogprobs

FLOOR = -9999.0


def _clamp(v: float) -> float:
    return max(v, FLOOR)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table (byte-level BPE), reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a slow tokenizer, or none: no byte-level table
        return False
    parts = decoder.get("decoders") or [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts if isinstance(p, dict))


class TokenTexts:
    """Each token id's text and bytes, decoded once (one per front door)."""

    def __init__(self, tokenizer=None, decode: Callable[[list[int]], str] | None = None):
        if tokenizer is None and decode is None:
            raise ValueError("TokenTexts needs a tokenizer or a decode function")
        self._tok = tokenizer
        self._decode = decode
        self._bytes_of = _byte_level_decoder() if tokenizer is not None and _is_byte_level(
            tokenizer) else None
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def decode(self, token_ids: list[int]) -> str:
        """Several tokens' text (special tokens kept: echo's prompt)."""
        return self._tok.decode(token_ids) if self._tok is not None else \
            self._decode(token_ids)

    def text(self, token_id: int) -> str:
        s = self._texts.get(token_id)
        if s is None:
            try:
                s = self._tok.decode([token_id]) if self._tok is not None else \
                    self._decode([token_id])
            except Exception:  # an id past the tokenizer's table (a padded vocabulary)
                s = ""
            self._texts[token_id] = s = s or ""
        return s

    def bytes(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            b = None
            if self._bytes_of is not None:
                piece = self._tok.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in self._bytes_of for c in piece):
                    b = [self._bytes_of[c] for c in piece]
            if b is None:
                b = list(self.text(token_id).encode("utf-8", errors="replace"))
            self._bytes[token_id] = b
        return b


@dataclass
class LogprobsView:
    """How one request shows its log-probs; `offset` carries text_offset across chunks."""

    texts: TokenTexts
    offset: int = 0

    def completion(self, token_ids: Sequence[int],
                   entries: Sequence[TokenLogprobs | None]) -> dict:
        """`entries[i]` is token i's (None: a first prompt token, shown as null)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, lp in zip(token_ids, entries, strict=True):
            text = self.texts.text(tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_clamp(lp.logprob))
            top = {text: _clamp(lp.logprob)}
            for t, v in lp.top:
                top.setdefault(self.texts.text(t), _clamp(v))
            out["top_logprobs"].append(top)
        return out

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict:
        t = self.texts
        return {"content": [
            {"token": t.text(lp.token_id), "logprob": _clamp(lp.logprob),
             "bytes": t.bytes(lp.token_id),
             "top_logprobs": [{"token": t.text(i), "logprob": _clamp(v), "bytes": t.bytes(i)}
                              for i, v in lp.top]}
            for lp in entries]}

    def prompt(self, entries: PromptLogprobs) -> list[dict | None]:
        """vLLM's prompt_logprobs list."""
        out: list[dict | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            ranked = {lp.token_id: (lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top, start=1):
                ranked.setdefault(t, (v, rank))
            out.append({str(t): {"logprob": _clamp(v), "rank": r,
                                 "decoded_token": self.texts.text(t)}
                        for t, (v, r) in ranked.items()})
        return out
