"""benchmarks.run --resume on the CPU (wall-clock timing): a run cut short by its budget is
completed by a second call that measures only what the first skipped."""

import json

from benchmarks.records import SKIP
from benchmarks.run import main


def _record(out):
    return json.loads((out / "results.json").read_text())


def test_a_resumed_run_measures_only_what_was_skipped(tmp_path, monkeypatch):
    # CPU tensors take the generated torch path (conftest's interpreter would be slow here)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    common = ["--out", str(tmp_path), "--cpu-smoke", "--ops", "softmax",
              "--providers", "vjpforge,torch"]
    main([*common, "--shapes", "64x256,128x1024"])
    first = _record(tmp_path)
    # as a spent budget leaves them: torch's cells skipped, and at 128x1024 one mode of
    # vjpforge too (the budget may run out between the modes of one provider)
    for row in first["measurements"]:
        if row["provider"] == "torch" or (row["shape"] == "128x1024" and row["mode"] == "fwd+bwd"):
            row.update(status=SKIP, median_ms=None, gbps=None, message="time budget used up")
    (tmp_path / "results.json").write_text(json.dumps(first))
    kept = {m["mode"]: m["median_ms"] for m in first["measurements"]
            if m["provider"] == "vjpforge" and m["shape"] == "64x256"}

    main([*common, "--resume"])
    second = _record(tmp_path)
    cells = [(m["dtype"], m["shape"], m["provider"], m["mode"]) for m in second["measurements"]]
    # every cell once: the partly skipped vjpforge 128x1024 was measured again whole
    assert len(cells) == len(set(cells)) == second["meta"]["planned_measurements"]
    assert all(m["status"] == "ok" for m in second["measurements"])
    assert {m["mode"]: m["median_ms"] for m in second["measurements"]
            if m["provider"] == "vjpforge" and m["shape"] == "64x256"} == kept
    assert len(second["host_overhead"]) == len(first["host_overhead"])  # measured once
    assert second["copy"] == first["copy"]
    assert len(second["meta"]["resumed"]) == 1
    assert any(note.startswith("Resumed on") for note in second["notes"])

    # a third call has nothing left to measure: the record stays as it is
    main([*common, "--resume"])
    third = _record(tmp_path)
    assert third["measurements"] == second["measurements"]
    assert third["notes"] == second["notes"]
