"""benchmarks/counters.py on the CPU: reading ncu's raw CSV and printing the reasons table."""

from __future__ import annotations

import csv
import io

from benchmarks import counters


def ncu_log(rows: list[dict]) -> str:
    """A `ncu --csv --page raw` log as ncu writes it: its own lines, the header, a units row,
    then one row per launch."""
    metrics = [metric for _label, metric in counters.METRICS]
    metrics += [counters._stall_metric(reason) for reason in counters.STALLS]
    header = ["ID", "Process ID", "Kernel Name", *metrics]
    out = io.StringIO()
    out.write("==PROF== Connected to process 1 (/usr/bin/python3)\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(header)
    writer.writerow(["", "", "", *["byte" if "bytes" in m else "" for m in metrics]])
    for index, row in enumerate(rows):
        writer.writerow([str(index), "1", row["kernel"], *[row.get(m, "") for m in metrics]])
    return out.getvalue()


def test_parse_reads_each_launch_in_order():
    log = ncu_log([
        {"kernel": "_layernorm_fwd_per", "dram__bytes_read.sum": "16,792,320",
         "dram__bytes_write.sum": "0", counters._stall_metric("barrier"): "0.5",
         counters._stall_metric("long_scoreboard"): "3.25"},
        {"kernel": "_softmax_bwd_default_red", "dram__bytes_read.sum": "n/a"},
    ])
    first, second = counters.parse(log, 2)
    assert first["kernel"] == "_layernorm_fwd_per"
    assert first["dram_read"] == 16792320.0 and first["dram_write"] == 0.0
    assert list(first["stalls"]) == ["long_scoreboard", "barrier"]  # most first, zeros left out
    assert second["dram_read"] is None and second["stalls"] == {}


def test_parse_says_when_launches_and_cases_disagree():
    log = ncu_log([{"kernel": "_layernorm_fwd_per"}])
    assert "1 launches for 2 cases" in counters.parse(log, 2)


def test_table_reads_bytes_against_the_model_and_the_copy_at_size():
    result = {"op": "layernorm", "mode": "fwd", "m": 4, "n": 8, "schedule": {
        "looped": True, "block_n": 8, "one_sweep": True, "rows": 1, "warps": 4, "programs": 4,
        "stages": 1}, "regs": 32, "spills": 0, "gbps": 100.0, "pct_copy": 3.3,
        "copy_here_gbps": 200.0, "model_bytes": 100,
        "ncu": {"dram_read": 80.0, "dram_write": 40.0, "dram_pct": 50.0,
                "stalls": {"barrier": 2.0}}}
    report = {"device": "d", "torch": "t", "triton": "x", "date": "now", "copy_gbps": 3000.0,
              "ncu_note": None, "results": [result]}
    row = counters.table(report).splitlines()[-1]
    assert "looped 8 one sweep" in row and "| 50% of 200 |" in row and "| 1.20 |" in row
    assert "barrier 2.0" in row
    result["schedule"]["reverse"] = True  # every other sweep backwards (the form's bit 4)
    assert "looped 8 one sweep reversed," in counters.table(report).splitlines()[-1]


def test_default_cases_cover_the_grid_and_cross_entropy_s_vocabularies():
    found = counters.cases(["layernorm", "cross_entropy"], None, ["fwd"])
    assert ("layernorm", "fwd", 4096, 32768) in found
    assert ("cross_entropy", "fwd", 8192, 128256) in found
    assert all(case[1] == "fwd" for case in found)
