"""The crossover benchmark's harness, on tiny CPU sizes (its numbers mean nothing there), and
how it turns measurements into the dispatch table."""

import pytest

from benchmarks import crossover


def test_crossover_smoke(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = crossover.main(["--cpu-smoke", "--ops", "layernorm,swiglu,bias_dropout_add",
                           "--out", str(out)])
    assert {row["op"] for row in rows} == {"layernorm", "swiglu", "bias_dropout_add"}
    assert {(row["rows"], row["cols"]) for row in rows} == {(4, 64), (16, 64)}
    assert all(row["ours_us"] > 0 and row["torch_us"] > 0 for row in rows)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| op |")
    assert out.read_text().count('"op"') == len(rows)


def row(op, rows, ours, theirs, cols=10):
    return {"op": op, "rows": rows, "cols": cols, "ours_us": ours, "torch_us": theirs}


def test_eager_below_is_where_the_kernels_win_from_then_on():
    rows = [row("a", 1, 300, 100), row("a", 10, 210, 200), row("a", 100, 150, 300),
            row("a", 1000, 100, 400), row("b", 1, 90, 100), row("b", 10, 200, 100),
            row("b", 100, 90, 100), row("c", 1, 90, 100)]
    # a: slower up to 10 rows, then faster; b: faster at 1 row but slower at 10, so from 100
    # rows; c: faster from the smallest size measured (below it: not measured, torch's)
    assert crossover.choose(rows) == {"a": {"eager_below": 100 * 100},
                                      "b": {"eager_below": 100 * 100},
                                      "c": {"eager_below": 100}}


def test_one_noisy_cell_near_parity_does_not_move_the_crossover():
    rows = [row("a", 1, 200, 100), row("a", 10, 90, 100), row("a", 100, 101, 100),
            row("a", 1000, 90, 100)]
    assert crossover.choose(rows) == {"a": {"eager_below": 10 * 100}}


def test_within_the_margin_torch_is_kept():
    assert crossover.choose([row("a", 1, 99, 100)]) == {"a": {"eager_below": 101}}


def test_work_grows_with_the_square_of_the_width():
    # same elements, four times the multiply work: the wider rows are past the crossover
    rows = [row("a", 40, 150, 100, cols=10), row("a", 10, 90, 100, cols=40)]
    assert crossover.choose(rows) == {"a": {"eager_below": 10 * 40 * 40}}


def test_compiled_choice_is_the_faster_at_the_largest_size():
    rows = [{"op": "a", "rows": 8, "cols": 10, "compiled_ours_us": 50, "compiled_torch_us": 100},
            {"op": "a", "rows": 80, "cols": 10, "compiled_ours_us": 120,
             "compiled_torch_us": 100},
            row("a", 80, 1, 2, cols=10)]
    assert crossover.choose(rows) == {"a": {"eager_below": 8000, "compiled": "torch"}}
    assert crossover.choose(rows[:2]) == {"a": {"compiled": "torch"}}


def test_forward_only_rows_choose_infer_below_apart(tmp_path, capsys):
    rows = [row("a", 1, 300, 100), row("a", 10, 90, 100),
            {"op": "a", "rows": 1, "cols": 10, "infer_ours_us": 90, "infer_torch_us": 100},
            {"op": "a", "rows": 10, "cols": 10, "infer_ours_us": 80, "infer_torch_us": 100}]
    # forward+backward wins from 10 rows, the forward alone from 1
    assert crossover.choose(rows) == {"a": {"eager_below": 10 * 100, "infer_below": 100}}
    out = tmp_path / "rows.json"
    smoke = crossover.main(["--cpu-smoke", "--inference", "--ops", "layernorm",
                            "--out", str(out)])
    assert all(r["infer_ours_us"] > 0 and r["infer_torch_us"] > 0 and "ours_us" not in r
               for r in smoke)
    assert set(crossover.choose(smoke)["layernorm"]) == {"infer_below"}
    assert capsys.readouterr().out.splitlines()[0].startswith("| op (forward) |")


def test_the_table_takes_infer_below_and_refuses_unknown_fields():
    from codegen.schedule import ScheduleTable

    table = ScheduleTable(measured_table={"ops": {}, "borrow": {}, "dispatch": {
        "a": {"eager_below": 5, "infer_below": 3}, "b": {"eager_bellow": 1}}})
    assert table.dispatch("a") == {"eager_below": 5, "infer_below": 3}
    with pytest.raises(ValueError, match="unknown \\['eager_bellow'\\]"):
        table.dispatch("b")


def test_choices_from_saved_rows(tmp_path):
    saved = tmp_path / "rows.json"
    saved.write_text('[{"op": "a", "rows": 2, "cols": 3, "ours_us": 1, "torch_us": 2}]')
    assert crossover.main(["--from", str(saved)]) == [row("a", 2, 1, 2, cols=3)]


def test_choices_go_to_the_table_in_use(tmp_path, monkeypatch):
    import json

    import codegen.schedule

    table = tmp_path / "table.json"
    table.write_text('{"ops": {}, "borrow": {}, "dispatch": {"a": {"compiled": "torch"}}}')
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", table)
    crossover.write_table({"a": {"eager_below": 5}, "b": {"eager_below": 7}})
    assert json.loads(table.read_text())["dispatch"] == {
        "a": {"compiled": "torch", "eager_below": 5}, "b": {"eager_below": 7}}
