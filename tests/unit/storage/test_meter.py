"""The byte meter behind the progress of saves and loads: throttled, monotonic, thread-safe."""

from __future__ import annotations

import threading
from typing import List

from dist_ckpt.storage.meter import ByteMeter, count_bytes, metering


def test_reports_each_hundredth_of_the_total_or_after_a_pause_never_past_the_total() -> None:
    now = [0.0]
    seen: List[int] = []
    meter = ByteMeter(1000, seen.append, clock=lambda: now[0])
    for _ in range(30):
        meter.add(1)  # 30 bytes, no time passing: a report each 10 bytes (1 %)
    assert seen == [10, 20, 30]
    meter.add(1)
    now[0] += 0.25  # a fifth of a second later, one byte more is worth a report
    meter.add(1)
    assert seen[-1] == 32
    meter.add(5000)  # headers and indexes: more than the tensors counted in the total
    meter.add(1)
    assert seen[-1] == 1000 and seen.count(1000) == 1 and meter.done == 5033


def test_concurrent_counts_add_up_and_reports_never_go_back() -> None:
    seen: List[int] = []
    meter = ByteMeter(8 * 10_000, seen.append, fraction=0.0, interval_s=3600)  # a report for every change
    threads = [threading.Thread(target=lambda: [meter.add(1) for _ in range(10_000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.done == 80_000 and seen == sorted(seen) and len(set(seen)) == len(seen) and seen[-1] == 80_000


def test_only_an_installed_meter_counts_and_an_inner_one_leaves_the_outer_counting() -> None:
    outer = ByteMeter(100, lambda done: None)
    inner = ByteMeter(100, lambda done: None)
    count_bytes(7)  # nothing installed: nobody counts
    with metering(outer) as counting:
        assert counting
        with metering(inner) as inner_counting:
            assert not inner_counting
            count_bytes(5)
        count_bytes(1)
    count_bytes(3)
    assert (outer.done, inner.done) == (6, 0)


def test_a_report_that_moves_bytes_itself_counts_them_without_a_deadlock() -> None:
    seen: List[int] = []

    def report(done: int) -> None:
        seen.append(done)
        count_bytes(3)  # e.g. a callback that writes a metrics file through dist_ckpt

    meter = ByteMeter(100, report)
    with metering(meter):
        count_bytes(50)
    assert seen == [50] and meter.done == 53
