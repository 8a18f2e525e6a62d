"""benchmarks.run times each shape's providers in rounds of alternating order and pools each
cell's samples (CPU, wall-clock timing)."""

import json

import pytest

from benchmarks import run
from benchmarks.timing import Stats, pooled


def test_pooled_stats_are_those_of_all_samples():
    first = Stats.from_samples([3.0, 1.0, 2.0], host_ms=0.5, dropped=1)
    second = Stats.from_samples([10.0, 20.0], host_ms=1.5, dropped=2)
    both = pooled([first, second])
    assert both.samples_ms == (1.0, 2.0, 3.0, 10.0, 20.0)
    assert both.median_ms == 3.0 and both.min_ms == 1.0 and both.iterations == 5
    assert both.dropped == 3 and both.host_ms == 1.0
    with pytest.raises(ValueError, match="at least one Stats"):
        pooled([])


def test_providers_are_timed_in_rounds_of_alternating_order(tmp_path, monkeypatch):
    # CPU tensors take the generated torch path (conftest's interpreter would be slow here)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    timed = []
    measure = run.measure

    def spy(clock, work, rep_ms):
        timed.append(rep_ms)
        return measure(clock, work, rep_ms)

    monkeypatch.setattr(run, "measure", spy)
    original = run.make_workload
    order = []

    def named(fn, inputs, mode):
        order.append((getattr(fn, "provider", None), mode))
        return original(fn, inputs, mode)

    monkeypatch.setattr(run, "make_workload", named)
    loads = run.ProviderCache.get

    def tagged(self, provider, op):
        fn = loads(self, provider, op)
        fn.provider = provider.name
        return fn

    monkeypatch.setattr(run.ProviderCache, "get", tagged)
    run.main(["--out", str(tmp_path), "--cpu-smoke", "--ops", "softmax",
              "--providers", "vjpforge,torch", "--shapes", "64x256", "--rep-ms", "4"])
    modes = ["fwd", "bwd", "fwd+bwd"]
    grid = order[-12:]  # after the host-overhead phase (modes fwd, fwd+bwd)
    assert grid == ([("vjpforge", m) for m in modes] + [("torch", m) for m in modes]
                    + [("torch", m) for m in modes] + [("vjpforge", m) for m in modes])
    assert timed[-12:] == [2.0] * 12  # each round half the timed milliseconds
    record = json.loads((tmp_path / "results.json").read_text())
    rows = [m for m in record["measurements"] if m["shape"] == "64x256"]
    assert len(rows) == 6 and all(m["status"] == "ok" for m in rows)
    # two rounds of at least MIN_ITERATIONS samples each, pooled
    assert all(m["iterations"] >= 20 for m in rows)
