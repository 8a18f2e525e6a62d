"""benchmarks.timing on the CPU, with a stand-in clock: a timed call whose host time outran
the GPU sleep before it is left out of the statistics."""

import time

from benchmarks.timing import Workload, measure


class FakeClock:
    """Leaves the host `covered_ms` per call; a call the work marks slow reads 9 ms, else 1."""

    def __init__(self, covered_ms):
        self.covered_ms = covered_ms
        self.asked = []
        self.slow = False
        self._intervals = []

    def sync(self):
        return None

    def cover_host_time(self, host_ms):
        self.asked.append(host_ms)
        return self.covered_ms

    def prepare(self):
        return None

    def start(self):
        self.slow = False

    def stop(self):
        self._intervals.append(9.0 if self.slow else 1.0)

    def collect_ms(self):
        intervals, self._intervals = self._intervals, []
        return intervals


def _work(clock, slow_every):
    calls = [0]

    def call(_state):
        calls[0] += 1
        if slow_every and calls[0] % slow_every == 0:
            clock.slow = True
            time.sleep(0.004)  # 4 ms of host time, past the 1 ms the clock leaves

    return Workload(call)


def test_calls_the_sleep_did_not_cover_are_dropped():
    clock = FakeClock(covered_ms=1.0)
    stats = measure(clock, _work(clock, slow_every=4), rep_ms=0.0)
    assert stats.iterations >= 5 and stats.dropped >= 2
    assert stats.median_ms == stats.p80_ms == 1.0  # no slow sample left in
    assert stats.iterations + stats.dropped == 10


def test_a_run_mostly_uncovered_is_repeated_with_a_longer_sleep_then_kept_and_counted():
    clock = FakeClock(covered_ms=1.0)
    stats = measure(clock, _work(clock, slow_every=1), rep_ms=0.0)
    # every call slow: asked for the estimate's slowest, then for at least twice that
    assert len(clock.asked) == 3 and clock.asked[2] >= 2 * clock.asked[1] >= 2 * 4.0
    assert stats.median_ms == 9.0 and stats.dropped == stats.iterations == 10


def test_covered_calls_are_all_kept():
    clock = FakeClock(covered_ms=1.0)
    stats = measure(clock, _work(clock, slow_every=0), rep_ms=0.0)
    assert stats.dropped == 0 and stats.iterations == 10 and stats.median_ms == 1.0
