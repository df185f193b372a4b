"""Incremental detokenization for streamed text deltas.

Decoding token by token breaks multi-byte characters and (for SentencePiece-style
tokenizers) the spaces that depend on the previous token, so each push decodes a short
window that starts a few tokens back (`prefix_offset`) and emits only the text past the
window's already-emitted part (`read_offset`), as vLLM does. When the window ends in
U+FFFD the last token is an incomplete UTF-8 sequence: hold the text back until later
tokens complete it. The final push reconciles against a decode of the whole output, so
the deltas always concatenate to `detokenize(all_tokens)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas; one instance per request."""

    def __init__(self, detokenize: Callable[[list[int]], str]):
        self._decode = detokenize
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start (context tokens, already emitted)
        self._read_offset = 0  # tokens before this are emitted
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add new tokens; returns the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        if final:
            return self._finish()
        if len(self._ids) == self._read_offset:
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character at the end
        if not window.startswith(prefix):
            return ""  # the decoder rewrote earlier text; resolved at the final push
        delta = window[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta

    def _finish(self) -> str:
        full = self._decode(self._ids)
        sent = self.text
        delta = full[len(sent):] if full.startswith(sent) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta
