"""tools/front_door_profile.py: py-spy's collapsed stacks -> the summary that
tools/control_plane.py --profile writes (waiting samples apart, stable native frames)."""

from __future__ import annotations

from pathlib import Path

from tools.front_door_profile import read_collapsed, stable_frame, summarize


def test_native_addresses_become_file_offsets_and_lines_go(tmp_path: Path) -> None:
    maps = [(0x7F0000000000, 0x7F0000100000, 0x2000)]
    assert stable_frame("0x7f0000000010 (grpc/cygrpc.so)", maps) == "grpc/cygrpc.so+0x2010"
    assert stable_frame("0x1234 (libc.so.6)", maps) == "0x1234 (libc.so.6)"  # not mapped
    f = tmp_path / "p.collapsed"
    f.write_text("thread (1): Main;run (a/b.py:12);0x7f0000000010 (grpc/cygrpc.so) 3\n")
    assert read_collapsed(f, maps) == [
        (["thread (1): Main", "run (a/b.py)", "grpc/cygrpc.so+0x2010"], 3)]


def test_summary_counts_running_samples_apart_from_waiting_ones(tmp_path: Path) -> None:
    f = tmp_path / "p.collapsed"
    f.write_text("\n".join([
        "thread (1): Main;_run_once (asyncio/base_events.py:1);select (selectors.py:9);"
        "epoll_wait (libc.so.6) 6",  # idle loop
        "thread (1): Main;_run_once (asyncio/base_events.py:1);Generate (servicer.py:3) 3",
        "thread (1): Main;_run_once (asyncio/base_events.py:2);sendmsg (libc.so.6) 1",
        "thread (2): detok;get (queue.py:1);PyThread_acquire_lock_timed (libpython) 10",
    ]) + "\n")
    text = summarize(read_collapsed(f), top=5)
    assert text.startswith("20 samples, 4 running")
    assert " 20.0% /  30.0%  thread (1): Main" in text
    assert "  0.0% /  50.0%  thread (2): detok" in text
    self_part = text.split("by self")[1].split("by inclusive")[0]
    assert " 75.0%  Generate (servicer.py)" in self_part
    assert " 25.0%  sendmsg (libc.so.6)" in self_part
    assert "epoll_wait" not in self_part
    assert "100.0%  _run_once (asyncio/base_events.py)" in text.split("by inclusive")[1]
