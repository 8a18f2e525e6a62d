"""The user-level benchmark commands (benchmarks.host, benchmarks.layers_step,
benchmarks.models) run on the CPU with --cpu-smoke and produce well-formed tables and JSON;
what they check (same weights as Hugging Face's layers, the patched model's loss) holds; Liger's
absence and a failing variant are reported, not fatal."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import host, layers_step, models

REPO_ROOT = Path(__file__).resolve().parents[1]
NOT_OPS = {"__init__", "patch", "bert_layer", "gpt_layer"}


@pytest.fixture(autouse=True)
def keep_threads():
    """--cpu-smoke runs on one thread; the tests after these get torch's count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The cells of every row of each markdown table whose header starts with `header_start`;
    checks each row has the header's number of cells."""
    rows: list[list[str]] = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if not line.startswith(header_start):
            continue
        width = line.count("|")
        assert lines[index + 1].startswith("|---"), lines[index + 1]
        for row in lines[index + 2:]:
            if not row.startswith("|"):
                break
            assert row.count("|") == width, row
            rows.append([cell.strip() for cell in row.strip("|").split("|")])
    return rows


def test_host_covers_every_generated_op():
    """Every generated op module's function is measured (a new op must be added to host)."""
    modules = {path.stem for path in (REPO_ROOT / "generated").glob("*.py")} - NOT_OPS
    for name in modules:
        module = __import__(f"generated.{name}", fromlist=["_"])
        assert any(callable(getattr(module, op, None)) for op in host.OPS), name
    assert len(host.OPS) == len(modules)


def test_host_cpu_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path; restored after
    out = tmp_path / "host.json"
    assert host.main(["--cpu-smoke", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    records = data["records"]
    assert data["meta"]["calls"] > 0 and data["meta"]["repeats"] > 0
    cases = {(r["op"], r["shape"]) for r in records}
    assert {op for op, _ in cases} == set(host.OPS)
    assert len(cases) == 2 * len(host.OPS)  # two shapes each
    assert len(records) == len(cases) * len(host.MODES) * len(host.PROVIDERS)
    for record in records:
        assert record["error"] is None, record
        assert len(record["host_us_repeats"]) == data["meta"]["repeats"]
        assert record["host_us"] == statistics.median(record["host_us_repeats"])
        assert record["host_us"] > 0 and math.isfinite(record["host_us"])
        assert record["gpu_us"] is None  # no GPU time on the CPU
    rows = table_rows(text, "| op | shape | ours µs")
    assert len(rows) == len(cases) * len(host.MODES)
    cells = {(r["op"], r["shape"], r["mode"], r["provider"]): r for r in records}
    for index, row in enumerate(rows):
        mode = host.MODES[index // len(cases)]
        ours, theirs = (cells[row[0], row[1], mode, p]["host_us"] for p in host.PROVIDERS)
        assert float(row[4]) == pytest.approx(ours / theirs, abs=0.006)
        assert row[5:] == ["—"] * 4


def test_layers_step_cpu_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "layers.json"
    assert layers_step.main(["--cpu-smoke", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    records = json.loads(out.read_text())["records"]
    assert [r["label"] for r in records] == [label for _, label, _, _ in layers_step.ROWS]
    for record in records:
        assert record["error"] is None, record
        assert record["ms"] > 0 and record["saved_bytes"] > 0
        if not record["hf"]:
            # fp32: the generated layer and Hugging Face's hold the same weights
            assert record["max_err_vs_hf"] < 1e-5, record
    by_label = {(r["group"], r["label"]): r for r in records}
    for group in ("BERT", "GPT"):
        plain = by_label[group, 'ours, attention="materialized"']
        every = by_label[group, "ours, materialized, all three"]
        assert every["saved_bytes"] < plain["saved_bytes"]
    rows = table_rows(text, "| layer | variant")
    assert len(rows) == len(records)
    # an option row shows its cost and what it saves against the row without options
    row = next(r for r in rows if r[1] == "ours, materialized, all three")
    assert row[8] != "—" and row[9].split(" / ")[0] != "—"


def test_models_cpu_smoke_without_liger(tmp_path, capsys, monkeypatch):
    """Two variants, each in its own process; Liger made unimportable is reported."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if not installed
    out = tmp_path / "models.json"
    assert models.main(["--cpu-smoke", "--models", "llama", "--variants",
                        "eager,patched,liger", "--jobs", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    records = {r["variant"]: r for r in data["records"]}
    assert set(records) == {"eager", "patched", "liger"}
    eager, patched, liger = records["eager"], records["patched"], records["liger"]
    for record in (eager, patched):
        assert record["status"] == "ok", record
        assert record["step_ms"] > 0 and len(record["step_ms_repeats"]) == data["meta"]["steps"]
    assert patched["swapped"].get("LlamaRMSNorm", 0) > 0
    # the same weights and batch: the patched model's loss is the model's (fp32)
    assert patched["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-5)
    assert liger["status"] == "unavailable" and "not installed" in liger["error"]
    rows = table_rows(text, "| model | size | variant")
    assert [row[2] for row in rows] == ["eager", "patched", "liger"]
    assert rows[2][-1].startswith("unavailable: liger-kernel is not installed")


def test_models_liger_without_function_is_not_run(monkeypatch):
    monkeypatch.setattr(models, "liger_functions", lambda: ({"llama"}, ""))
    monkeypatch.setattr(models, "run_child", lambda spec, timeout: pytest.fail("ran a child"))
    specs = models.plan(["gpt2", "bert"], ["small"], ["liger"], smoke=True, steps=1)
    records = models.run_all(specs, budget_s=60, timeout_s=60, jobs=1, progress=print)
    assert [r["status"] for r in records] == ["n/a", "n/a"]
    assert records[0]["error"] == "Liger-Kernel has no apply_liger_kernel_to_gpt2"


def test_models_build_every_family_and_name_ligers_function():
    """Every model builds at the smoke size, and the Liger function asked for is the one
    Liger names for it."""
    for model in models.MODELS:
        built = models.build_model(model, models.SMOKE_SIZE, "cpu")
        assert sum(p.numel() for p in built.parameters()) > 0, model
    assert models.liger_function("gemma3") == "apply_liger_kernel_to_gemma3_text"
    assert models.liger_function("llama3") == "apply_liger_kernel_to_llama"
    assert models.liger_function("mixtral") == "apply_liger_kernel_to_mixtral"


def test_models_rounds_interleave_and_merge(monkeypatch):
    """--rounds runs a model's variants in turn, round after round, every other round in the
    opposite order, and the table's record of a variant is the median of its rounds (their
    range shown), the largest peak, or the first failure of any round."""
    specs = models.plan(["llama"], ["small"], ["eager", "patched"], smoke=True, steps=1,
                        rounds=3)
    assert [(s["variant"], s["round"]) for s in specs] == [
        ("eager", 0), ("patched", 0), ("patched", 1), ("eager", 1), ("eager", 2), ("patched", 2)]
    times = iter([5.0, 9.0, 8.0, 1.0, 3.0, 7.0])
    peaks = iter([10, 20, 30, 40, 50, 60])

    def child(spec, timeout):
        record = {**models._base(spec), "status": "ok", "step_ms": next(times),
                  "peak_bytes": next(peaks)}
        if spec["variant"] == "patched" and spec["round"] == 1:
            record.update(status="oom", error="out of memory")
        return record

    monkeypatch.setattr(models, "run_child", child)
    records = models.merge_rounds(models.run_all(specs, budget_s=60, timeout_s=60, jobs=1,
                                                 progress=print))
    eager, patched = records
    assert eager["step_ms"] == 3.0 and eager["step_ms_rounds"] == [5.0, 1.0, 3.0]
    assert eager["peak_bytes"] == 50
    assert patched["status"] == "oom"
    row = table_rows(models.table(records, ("eager", "patched")), "| model | size")[0]
    assert row[3] == "3.00 (1.00–5.00)"


def test_models_failures_are_records(capsys, monkeypatch):
    """A variant that raises prints an error record; one that outlives its timeout is
    reported as such."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the child drops it; restored after
    spec = models.plan(["llama"], ["small"], ["eager"], smoke=True, steps=1)[0]
    spec["model"] = "t5"
    assert models.child_main(json.dumps(spec)) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["status"] == "error" and "model must be one of" in record["error"]
    record = models.run_child({**spec, "model": "llama"}, timeout_s=0.2)
    assert record["status"] == "timeout" and "--timeout-s" in record["error"]


def test_linear_loss_cpu_smoke(capsys):
    """The head + loss benchmark runs its variants and prints one row each, the chunk sizes
    asked for included."""
    from benchmarks import linear_loss

    assert linear_loss.main(["--cpu-smoke", "--reps", "1", "--chunks", "default,4"]) == 0
    rows = table_rows(capsys.readouterr().out, "| variant")
    assert [row[0] for row in rows] == ["torch, logits whole", "ours, chunk default",
                                        "ours, chunk 4"]
    assert all(float(row[1]) > 0 and row[2] == "—" for row in rows)
