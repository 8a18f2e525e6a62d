"""benchmarks.tune's table writing on the CPU: how measurements of several runs become one entry."""

from benchmarks.tune import _shared_16bit, _shared_rows


def _config(rows, warps, gbps):
    return {"rows": rows, "warps": warps, "per_sm": 0, "stages": 1, "step": 0, "gbps": gbps}


def _result(m, dtype, configs, n=512):
    return {"op": "softmax", "mode": "bwd", "m": m, "n": n, "dtype": dtype, "configs": configs}


def test_an_entry_is_the_fastest_over_the_row_counts_of_its_width():
    # (2, 1) wins at 16384 rows and loses at 4096; (4, 4) is second at both and wins over both
    results = [_result(16384, "torch.bfloat16", [_config(2, 1, 2200), _config(4, 4, 2150),
                                                 _config(8, 8, 2000)]),
               _result(4096, "torch.bfloat16", [_config(2, 1, 1200), _config(4, 4, 1350),
                                                _config(4, 4, 1300)])]
    [shared] = _shared_rows(results)
    speeds = {(c["rows"], c["warps"]): c["gbps"] for c in shared["configs"]}
    # (8, 8) was not measured at 4096 rows: no candidate; a repeat counts at its fastest
    assert set(speeds) == {(2, 1), (4, 4)}
    assert abs(speeds[(4, 4)] - (2150 * 1350) ** 0.5) < 1e-6
    assert abs(speeds[(2, 1)] - (2200 * 1200) ** 0.5) < 1e-6
    assert max(speeds, key=speeds.get) == (4, 4)


def test_widths_dtypes_and_single_shapes_stay_apart():
    one = _result(4096, "torch.bfloat16", [_config(1, 1, 100)])
    wider = _result(16384, "torch.bfloat16", [_config(2, 2, 200)], n=1024)
    fp32 = _result(16384, "torch.float32", [_config(4, 4, 300)])
    assert _shared_rows([one, wider, fp32]) == [one, wider, fp32]


def test_fp16_and_bf16_share_each_configuration_at_its_slower_speed():
    results = [_result(4096, "torch.bfloat16", [_config(2, 1, 1400), _config(4, 4, 1300)]),
               _result(4096, "torch.float16", [_config(2, 1, 1200), _config(4, 4, 1290)])]
    [shared] = _shared_16bit(results)
    speeds = {(c["rows"], c["warps"]): c["gbps"] for c in shared["configs"]}
    assert speeds == {(2, 1): 1200, (4, 4): 1290}


def test_a_configuration_measured_twice_in_one_dtype_only_is_no_shared_candidate():
    # (2, 1) measured twice on bf16 (the tuned run and the module's default) and never on fp16
    results = [_result(4096, "torch.bfloat16", [_config(2, 1, 1400), _config(2, 1, 1390),
                                                _config(4, 4, 1300)]),
               _result(4096, "torch.float16", [_config(4, 4, 1290)])]
    [shared] = _shared_16bit(results)
    assert [(c["rows"], c["warps"], c["gbps"]) for c in shared["configs"]] == [(4, 4, 1290)]


def test_a_padded_width_is_an_entry_of_its_own(tmp_path, monkeypatch):
    # a width that is not a power of two is filed under itself, next to (not over) the entry of
    # its power-of-two block
    import json

    import codegen.schedule
    from benchmarks.tune import write_table

    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [_result(4096, "torch.bfloat16", [_config(2, 4, 900)], n=12288)]}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    previous = codegen.schedule.load_measured()["ops"]["softmax"]["bwd"]
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    written = json.loads(write_table([tmp_path / "tune.json"], "test").read_text())
    widths = written["ops"]["softmax"]["bwd"]
    assert widths["12288"] == [2, 4, 0, 1, 0]
    assert widths["16384"] == previous["16384"]


def test_plain_form_keeps_masks_and_the_row_block_loop():
    from benchmarks.tune import _form
    from generated import layernorm

    # as _schedule sets them: 4096 rows in blocks of 2 tile exactly; 2048 programs cover them
    assert _form(layernorm, 4096, 512, 2, 512, 2048, plain=False) == (True, False)
    assert _form(layernorm, 4095, 512, 2, 512, 264, plain=False) == (False, True)
    # --plain: the form before session 9 whatever the shape
    assert _form(layernorm, 4096, 512, 2, 512, 2048, plain=True) == (False, True)


def test_plain_measurements_are_no_table_source(tmp_path):
    import json

    import pytest

    from benchmarks.tune import write_table

    config = _config(2, 4, 900) | {"plain": True}
    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [_result(4096, "torch.bfloat16", [config])]}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="--plain"):
        write_table([tmp_path / "tune.json"], "test")
