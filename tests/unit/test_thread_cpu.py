"""tools/thread_cpu.py: the CPU per thread of a process (/proc) and its table."""

from __future__ import annotations

import os
import threading

from tools.thread_cpu import table, thread_times


def test_thread_times_lists_this_thread():
    snap = thread_times(os.getpid())
    name, cpu = snap[threading.get_native_id()]
    assert name and cpu >= 0.0
    assert thread_times(-1) == {}  # no such process: nothing, no error


def test_table_orders_threads_by_cpu_over_the_window_per_token():
    before = {1: ("loop", 1.0), 2: ("writer", 0.5)}
    after = {1: ("loop", 3.0), 2: ("writer", 0.8), 3: ("new", 0.25)}  # 3 started inside
    lines = table(before, after, tokens=1000).splitlines()
    assert [line.split()[0:2] for line in lines[1:4]] == [
        ["loop", "(1)"], ["writer", "(2)"], ["new", "(3)"]]
    assert lines[1].split()[2:4] == ["2.00", "2000.0"]  # seconds, us per token
    assert lines[-1].split()[1:3] == ["2.55", "2550.0"]
