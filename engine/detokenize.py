"""Incremental detokenization for streamed text deltas, one request or a whole step at once.

Decoding token by token breaks multi-byte characters and (for SentencePiece-style
tokenizers) the spaces that depend on the previous token, so each push decodes a short
window that starts a few tokens back (`prefix_offset`) and emits only the text past the
window's already-emitted part (`read_offset`), as vLLM does. When the window ends in
U+FFFD the last token is an incomplete UTF-8 sequence: hold the text back until later
tokens complete it. The final push reconciles against a decode of the whole output, so
the deltas always concatenate to `detokenize(all_tokens)`.

A push is two steps, `windows()` (the id sequences to decode) and `accept()` (their
texts -> the delta), so `BatchDecoder` decodes the windows of every request of a step in
one pass straight through the Rust backend (a byte-level BPE tokenizer's deltas come from
a table of each id's bytes instead); `DetokenizerThread` does that off the front door's
event loop (or on it, for such a table); `engine.LLM.stream` uses them in-process.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.detokenize_table import REPLACEMENT, byte_level_table, whole_text

__all__ = ["BatchDecoder", "DetokenizerThread", "IncrementalDetokenizer", "byte_level_table"]


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas; one instance per request."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None = None):
        self._decode = detokenize
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start (context tokens, already emitted)
        self._read_offset = 0  # tokens before this are emitted
        self._emitted: list[str] = []
        self._final = False
        self._pending = b""  # push_bytes: bytes of tokens whose text is not out yet

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add new tokens; returns the text they complete (possibly empty)."""
        return self.accept([self._decode(w) for w in self.windows(token_ids, final)])

    def windows(self, token_ids: Sequence[int], final: bool = False) -> list[list[int]]:
        """Add new tokens; the id sequences whose texts `accept` needs next."""
        self._ids.extend(token_ids)
        self._final = final
        if final:
            return [self._ids]
        if len(self._ids) == self._read_offset:
            return []
        return [self._ids[self._prefix_offset:self._read_offset], self._ids[self._prefix_offset:]]

    def accept(self, texts: list[str]) -> str:
        """The delta, from the texts of the sequences `windows` returned (in order)."""
        if self._final:
            return self._finish(texts[0])
        if not texts:
            return ""
        prefix, window = texts
        if len(window) <= len(prefix) or window.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character at the end
        if not window.startswith(prefix):
            return ""  # the decoder rewrote earlier text; resolved at the final push
        delta = window[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta

    def push_bytes(self, table: list[bytes], token_ids: Sequence[int], final: bool) -> str:
        """push() for a byte-level BPE tokenizer, from BatchDecoder's table (id -> the
        bytes it decodes to): the same deltas with no window decoded. The bytes since
        the last delta are held while their text ends in U+FFFD (an incomplete UTF-8
        sequence), as push() holds a window that does; each delta starts at a character
        boundary, so the deltas concatenate to the whole output's text. A detokenizer fed
        this way keeps only those held bytes (not its ids, nor `text`)."""
        try:
            new = b"".join([table[t] for t in token_ids])
        except IndexError:  # an id past the tokenizer's vocabulary decodes to nothing
            new = b"".join([table[t] if 0 <= t < len(table) else b"" for t in token_ids])
        pending = self._pending + new if self._pending else new
        if not pending:
            return ""
        text = pending.decode("utf-8", "replace")
        if not final and text[-1] == REPLACEMENT:
            self._pending = pending
            return ""
        self._pending = b""
        return text

    def _finish(self, full: str) -> str:
        sent = self.text
        delta = full[len(sent):] if full.startswith(sent) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta


class BatchDecoder:
    """`decode_many(seqs)` == [tokenizer.decode(s, skip_special_tokens=True) for s in seqs],
    straight through a fast (Rust) tokenizer's backend when its result is the same
    (checked on a probe at construction: no Python wrapper per call), else through the
    tokenizer's own decode."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._clean = None
        if self._backend is not None and hasattr(self._backend, "decode"):
            self._clean = self._cleanup_fn()
            probe = [list(range(3, 40)), [5, 7, 11], []]
            try:
                if self._fast(probe) != self._slow(probe):
                    self._backend = None
            except Exception:  # e.g. a probe id outside a tiny vocabulary
                self._backend = None
        else:
            self._backend = None
        self._table = byte_level_table(tokenizer) if self._clean is None else None
        # id -> its text when its bytes are whole UTF-8 characters (None: held or partial)
        self._texts = None if self._table is None else [whole_text(b) for b in self._table]

    def _cleanup_fn(self) -> Callable[[str], str] | None:
        tok = self.tokenizer
        if not getattr(tok, "clean_up_tokenization_spaces", False):
            return None
        model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
        if type(model).__name__ == "BPE" and not getattr(
                tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                False):
            return None
        return tok.clean_up_tokenization

    def _slow(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        return [self.tokenizer.decode(list(s), skip_special_tokens=True) for s in seqs]

    def _fast(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        # one call per sequence: the windows are a few tokens each, and `decode_batch`
        # spreads them over a thread pool that costs more than it saves (and more cores)
        decode = self._backend.decode
        out = [decode(s, True) for s in seqs]
        return [self._clean(t) for t in out] if self._clean is not None else out

    def decode_many(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        if not seqs:
            return []
        return self._fast(seqs) if self._backend is not None else self._slow(seqs)

    def push_text(self, detok: IncrementalDetokenizer, token_ids: Sequence[int]) -> str:
        """A non-final push of a byte-table decoder (the streaming hot path): a single
        token whose bytes are whole characters, with nothing held before it, is its text
        from the table; anything else goes through `push_bytes`."""
        if len(token_ids) == 1 and not detok._pending:
            try:
                text = self._texts[token_ids[0]]
            except IndexError:
                text = None
            if text is not None:
                return text
        return detok.push_bytes(self._table, token_ids, False)

    def push_many(self, items: Sequence[tuple[IncrementalDetokenizer, Sequence[int], bool]]
                  ) -> list[str]:
        """Push each (detokenizer, new ids, final) in order, with one batched decode per
        round (a detokenizer pushed twice, e.g. two queued steps, goes once per round);
        returns their deltas. A byte-level tokenizer's go through its byte table."""
        table = self._table
        if table is not None:
            return [d.push_bytes(table, ids, final) for d, ids, final in items]
        out: list[str] = [""] * len(items)
        pending = list(range(len(items)))
        while pending:
            seen: set[int] = set()
            now, later = [], []
            for i in pending:  # a detokenizer's later pushes wait for its earlier ones
                (later if id(items[i][0]) in seen else now).append(i)
                seen.add(id(items[i][0]))
            wins = [items[i][0].windows(items[i][1], items[i][2]) for i in now]
            texts = self.decode_many([w for ws in wins for w in ws])
            k = 0
            for i, ws in zip(now, wins, strict=True):
                out[i] = items[i][0].accept(texts[k:k + len(ws)])
                k += len(ws)
            pending = later
        return out


log = logging.getLogger(__name__)


class DetokenizerThread:
    """Detokenizes the front door's token deltas, on its own thread unless `inline`.

    `submit(items, deliver)` (on the event loop) queues a step's [(holder, ids, final)];
    the thread pushes them all through one BatchDecoder call (each holder keeps its
    IncrementalDetokenizer in `holder.detok`, touched by this thread only) and hands the
    texts back with `deliver(items, texts)` on the loop, in submission order.

    With a byte-level tokenizer's table a token costs a join and a UTF-8 decode, less
    than the hand-off itself (a wake-up of this thread, the GIL, a wake-up of the loop),
    which also delays every step's text: then (`inline`, the default for such a
    tokenizer) `submit` detokenizes at once and calls `deliver` before it returns."""

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop,
                 inline: bool | None = None):
        self.decoder = BatchDecoder(tokenizer)
        self.loop = loop
        self.inline = self.decoder._table is not None if inline is None else inline
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        if not self.inline:
            threading.Thread(target=self._run, name="pdserve-detokenize", daemon=True).start()

    def submit(self, items: list[tuple[Any, Sequence[int], bool]],
               deliver: Callable[[list, list[str]], None]) -> None:
        if self.inline:
            deliver(items, self._push(items))
        else:
            self._queue.put((items, deliver))

    def push_now(self, holder: Any, token_ids: Sequence[int]) -> str:
        """`inline` only: one holder's non-final tokens, detokenized at once (the
        streaming hot path: no item list, no callback)."""
        d = holder.detok
        if d is None:
            d = holder.detok = IncrementalDetokenizer()
        try:
            return self.decoder.push_text(d, token_ids)
        except Exception:  # as _push: a tokenizer failure must not stop the stream
            log.exception("detokenizing %d token(s) failed", len(token_ids))
            return ""

    def _push(self, items: list[tuple[Any, Sequence[int], bool]]) -> list[str]:
        for holder, _, _ in items:
            if holder.detok is None:
                holder.detok = IncrementalDetokenizer()
        try:
            return self.decoder.push_many([(h.detok, ids, f) for h, ids, f in items])
        except Exception:  # a tokenizer failure must not stop every stream's text
            log.exception("detokenizing a step failed")
            return [""] * len(items)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while True:  # take whatever queued meanwhile: one decode call for all of it
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            texts = self._push([it for its, _ in jobs for it in its])
            i = 0
            for its, deliver in jobs:
                self._hand_back(deliver, its, texts[i:i + len(its)])
                i += len(its)

    def _hand_back(self, deliver, items, texts) -> None:
        try:
            self.loop.call_soon_threadsafe(deliver, items, texts)
        except RuntimeError:  # the loop closed (shutdown)
            pass

    def stop(self) -> None:
        self._queue.put(None)
