"""Shared pieces of the unit tests that serve the tiny model through the local backend's
front doors: a ChatML chat model directory and the leak check."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_model_dir(model: Path, out: Path) -> Path:
    """A copy of `model` in `out` with a ChatML chat template (chat_template.jinja)."""
    for f in model.iterdir():
        shutil.copy(f, out / f.name)
    (out / "chat_template.jinja").write_text(CHATML)
    return out


def assert_idle(srv, backend, timeout: float = 30.0) -> None:
    """Leak check: nothing in flight, no block used, the block manager consistent."""
    end = time.monotonic() + timeout
    while True:
        st = srv.run(backend.stats())
        w = st.workers[0]
        idle = st.num_inflight == 0 and (w.num_running, w.num_waiting, w.kv_blocks_used) == (
            0, 0, 0) and not srv.server.state.active
        if idle or time.monotonic() > end:
            break
        time.sleep(0.02)
    assert idle, st
    backend.llm.block_manager.check_integrity()
