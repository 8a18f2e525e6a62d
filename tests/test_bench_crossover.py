"""The crossover benchmark's harness, on tiny CPU sizes (its numbers mean nothing there)."""

from benchmarks import crossover


def test_crossover_smoke(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = crossover.main(["--cpu-smoke", "--out", str(out)])
    ops = {row["op"] for row in rows}
    assert ops == {"layer_norm", "rms_norm", "gelu", "gelu(x + bias)", "swiglu", "softmax"}
    assert {(row["rows"], row["cols"]) for row in rows} == {(4, 64), (16, 64)}
    assert all(row["ours_us"] > 0 and row["torch_us"] > 0 for row in rows)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| op |") and len(table) == 2 + len(rows)
    assert out.read_text().count('"op"') == len(rows)
