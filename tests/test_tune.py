"""benchmarks.tune's table writing on the CPU: how measurements of several runs become one entry."""

import torch

from benchmarks import tune
from benchmarks.tune import _shared_16bit, _shared_rows
from codegen.runtime.schedules import form_of, maxnreg
from generated import softmax


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
    (tmp_path / "table.json").write_text(codegen.schedule.MEASURED_TABLE.read_text())
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    written = json.loads(write_table([tmp_path / "tune.json"], "test").read_text())
    widths = written["ops"]["softmax"]["bwd"]
    assert widths["12288"] == [2, 4, 0, 1, 0]
    assert widths["16384"] == previous["16384"]


def test_the_form_bits_set_masks_the_row_block_loop_and_the_sweep_direction():
    # 4096 rows in blocks of 2 tile exactly; 2048 programs, one per row block
    no = False
    assert form_of(4096, 512, 2, 512, 2048, 1) == (True, no, no, no, no)  # the rule
    assert form_of(4096, 512, 2, 512, 2048, 0) == (False, no, no, no, no)
    assert form_of(4096, 512, 2, 512, 2048, 2) == (False, True, no, no, no)
    assert form_of(4096, 512, 2, 512, 2048, 3) == (True, True, no, no, no)
    # no form drops masks that a partial row block needs, or the loop over several row blocks
    for form in range(32):
        assert form_of(4095, 512, 2, 512, 264, form)[:2] == (False, True)
    # bit 4 runs every other sweep backwards, where the row loops (BLOCK_N < N) and only there
    assert form_of(4096, 512, 1, 128, 4096, 5) == (True, no, True, no, no)
    assert form_of(4096, 512, 2, 512, 2048, 7) == (True, True, no, no, no)
    # bit 8 sets the register budget, for whole rows (BLOCK_N >= N) that programs loop over
    # (fewer programs than row blocks), and only there
    assert form_of(4096, 500, 2, 512, 264, 9) == (False, True, no, True, no)
    assert form_of(4096, 500, 2, 512, 2048, 9) == (False, no, no, no, no)
    assert form_of(4096, 512, 1, 128, 264, 13) == (True, True, True, no, no)
    # bit 16 compiles whole rows for their width, and only whole rows
    assert form_of(4096, 500, 2, 512, 2048, 17) == (False, no, no, no, True)
    assert form_of(4096, 512, 1, 128, 4096, 17) == (True, no, no, no, no)


def test_the_register_budget_splits_the_sms_register_file_over_the_programs_it_runs(monkeypatch):
    from collections import namedtuple

    import torch

    device = namedtuple("Device", "type index")
    properties = namedtuple("Properties", "multi_processor_count regs_per_multiprocessor")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: properties(132, 65536))
    maxnreg.cache_clear()
    try:
        # one program of 8 warps an SM: 256 registers a thread, capped at ptxas's 255
        assert maxnreg(8, 132, device("cuda", 0)) == 255
        assert maxnreg(16, 132, device("cuda", 0)) == 128
        # 264 programs: two an SM share the file; 133 programs: some SM runs two
        assert maxnreg(16, 264, device("cuda", 0)) == 64
        assert maxnreg(8, 133, device("cuda", 0)) == 128
        assert maxnreg(4, 1, device("cuda", 0)) == 255
        assert maxnreg(8, 132, device("cpu", None)) is None  # the interpreter
    finally:
        maxnreg.cache_clear()


def _forms(entry, config, speeds, op="layernorm", dtype="torch.bfloat16"):
    return {"op": op, "mode": "fwd", "m": 4096, "n": 32768, "dtype": dtype, "entry": entry,
            "config": config, "gbps": {str(form): gbps for form, gbps in enumerate(speeds)}}


def test_the_form_filed_is_the_best_at_the_entrys_slowest_shape():
    from benchmarks.tune import best_form

    # form 2 wins clearly at one shape and loses 1% at the other: its worst is 0.99
    records = [_forms(None, None, (2345, 2462, 2847, 2179)),
               _forms(None, None, (2700, 2800, 2772, 2790))]
    assert best_form(records) == 2
    # where the rule is within FORM_MARGIN of the best at its worst, it stays
    assert best_form([_forms(None, None, (1000, 995, 1004, 990))]) == 1
    # a shape where only one form differs from the others (rows that do not tile)
    assert best_form([_forms(None, None, (1441, 1209, 1428, 1209))]) == 0
    # the backwards sweeps (bit 4) compete where they were measured, and not where a record of
    # a run before them has four forms only
    looped = _forms(None, None, (1955, 1955, 1950, 1950, 2049, 2047, 2040, 2045))
    assert best_form([looped]) == 4
    assert best_form([looped, _forms(None, None, (1000, 1010, 1000, 1000))]) == 1
    # the register budget (bit 8) likewise: forms 8-15 where a record has them
    whole = _forms(None, None, (1350, 1349, 1340, 1340, 1350, 1349, 1340, 1340,
                                1530, 1528, 1520, 1520, 1530, 1528, 1520, 1520))
    assert best_form([whole]) == 8
    assert best_form([whole, looped]) == 1


def test_write_table_files_forms_under_the_entry_that_was_measured(tmp_path, monkeypatch):
    import json

    import codegen.schedule
    from benchmarks.tune import write_table

    table = codegen.schedule.load_measured()
    held = table["ops"]["layernorm"]["fwd_fp32"]["32768"]
    config = [*held, -1][:6] if len(held) < 6 else held[:6]
    records = [_forms(["fwd_fp32", 32768], config, (2345, 2462, 2847, 2179), dtype="torch.float32"),
               # the 16-bit entry at 8192, measured with another configuration than it holds
               _forms(["fwd", 8192], [9, 9, 0, 1, 2048, -1], (1, 2, 3, 4)),
               # a shape the rules' constants served: no entry to file it under
               _forms(None, None, (1, 2, 3, 4))]
    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [], "forms": records}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    (tmp_path / "table.json").write_text(codegen.schedule.MEASURED_TABLE.read_text())
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    written = json.loads(write_table([tmp_path / "tune.json"], "forms").read_text())
    assert written["ops"]["layernorm"]["fwd_fp32"]["32768"] == [*config, 2]
    assert written["ops"]["layernorm"]["fwd"]["8192"] == table["ops"]["layernorm"]["fwd"]["8192"]
    assert written["runs"][-1]["shapes"] == ["4096x32768"]
    # a later measurement that finds the rule's form best takes the field away again
    report["forms"] = [_forms(["fwd_fp32", 32768], config, (2400, 2800, 2700, 2600),
                              dtype="torch.float32")]
    (tmp_path / "tune.json").write_text(json.dumps(report))
    written = json.loads(write_table([tmp_path / "tune.json"], "forms").read_text())
    assert written["ops"]["layernorm"]["fwd_fp32"]["32768"] == config


def test_an_entrys_form_reaches_the_schedule(monkeypatch):
    from collections import namedtuple

    import torch

    from generated import layernorm

    properties = namedtuple("Properties", "multi_processor_count regs_per_multiprocessor")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: properties(132, 65536))
    # a looped forward entry (fp32 rows of 32768), a whole-row one with one program per row
    # block (16-bit rows of 512), and a whole-row backward whose 132 programs loop (fp32 1024)
    for key, grid_stride, element_size, form, flags in (
            (("fwd_fp32", 32768), False, 4, 1, (True, False, False, False)),
            (("fwd_fp32", 32768), False, 4, 2, (False, True, False, False)),
            (("fwd_fp32", 32768), False, 4, 0, (False, False, False, False)),
            (("fwd_fp32", 32768), False, 4, 5, (True, False, True, False)),
            (("fwd_fp32", 32768), False, 4, 13, (True, False, True, False)),
            (("fwd", 512), False, 2, 9, (True, False, False, False)),
            (("bwd_fp32", 1024), True, 4, 9, (True, True, False, True)),
            (("bwd_fp32", 1024), True, 4, 12, (False, True, False, True)),
            (("bwd_fp32", 1024), True, 4, 1, (True, True, False, False)),
            (("fwd", 512), False, 2, 17, (True, False, False, False, True)),
            (("fwd_fp32", 32768), False, 4, 17, (True, False, False, False, False))):
        table = layernorm.SCHEDULES.measured
        entry = (*table[key][:6], form)
        with layernorm.SCHEDULES.override(measured=table | {key: entry}):
            schedule = layernorm.SCHEDULES.choose(4096, key[1], grid_stride, key[0][:3], 1,
                                                  element_size, torch.device("cuda"))
        assert schedule.entry == key
        got = (schedule.even, schedule.strided, schedule.reverse, schedule.regs, schedule.fixed)
        assert got[:len(flags)] == flags


def test_fp32_rows_that_run_faster_in_another_form_get_an_entry_of_their_own(tmp_path,
                                                                              monkeypatch):
    import json

    import codegen.schedule
    from benchmarks.tune import write_table

    table = codegen.schedule.load_measured()
    held = table["ops"]["softmax"]["fwd"]["5120"]
    config = (held + [-1])[:6]
    bf16 = _forms(["fwd", 5120], config, (2910, 2910, 2633, 2633))
    fp32 = _forms(["fwd", 5120], config, (2744, 2744, 2906, 2906), dtype="torch.float32")
    fp32["stages"] = 1
    piped = table["ops"]["layernorm"]["bwd"]["4096"]  # 3 pipeline stages
    piped_config = (piped + [-1])[:6]
    no_stages = [_forms(["bwd", 4096], piped_config, (2400, 2400, 2400, 2400)),
                 _forms(["bwd", 4096], piped_config, (2468, 2433, 2468, 2433),
                        dtype="torch.float32")]
    for record in (bf16, fp32, *no_stages):
        record["op"] = "softmax" if record is bf16 or record is fp32 else "layernorm"
    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [], "forms": [bf16, fp32, *no_stages]}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    (tmp_path / "table.json").write_text(codegen.schedule.MEASURED_TABLE.read_text())
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    written = json.loads(write_table([tmp_path / "tune.json"], "forms").read_text())["ops"]
    # 16-bit rows keep the rule's form; fp32 rows get the configuration in the form they ran
    # faster in, at the stages they ran with
    assert written["softmax"]["fwd"]["5120"] == held[:6]
    assert written["softmax"]["fwd_fp32"]["5120"] == [*config[:3], 1, *config[4:], 2]
    # a record that does not say its pipeline stages, for an entry that pipelines: none filed
    assert "4096" not in written["layernorm"].get("bwd_fp32", {})


def test_the_modules_own_schedule_keeps_its_form_when_it_wins(tmp_path, monkeypatch):
    # the "default" candidate is timed in the form its entry holds; filed as the fastest, the
    # entry keeps that form, and a searched configuration (the rule's form) stays apart from it
    import json

    import codegen.schedule
    from benchmarks.tune import _signature, write_table

    searched = _config(1, 16, 2462) | {"step": 8192}
    default = _config(1, 16, 2858) | {"step": 8192, "form": 2, "default": True}
    assert _signature(searched) != _signature(default)
    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [_result(4096, "torch.bfloat16", [searched, default], n=32768)]}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    (tmp_path / "table.json").write_text(codegen.schedule.MEASURED_TABLE.read_text())
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    written = json.loads(write_table([tmp_path / "tune.json"], "test").read_text())["ops"]
    assert written["softmax"]["bwd"]["32768"] == [1, 16, 0, 1, 8192, -1, 2]


def test_tune_measures_with_every_split_rule_off():
    """`tune._unsplit` turns off both split rules (a softmax backward's is by row bytes), and
    restores them: a split schedule measured by `--forms` would be filed as a looped one."""

    def splits_at(n):
        return softmax.SCHEDULES.choose(64, n, False, "bwd", 2, 2, torch.device("cpu"), True).split

    assert splits_at(131072) == 1  # 256 KiB bf16 rows split
    with tune._unsplit(["softmax", "layernorm"]):
        assert splits_at(131072) == 0
    assert splits_at(131072) == 1


def test_the_residual_add_norms_are_filed_as_themselves(tmp_path, monkeypatch):
    # their kernels move 4 activation-sized tensors each way (the norm's 2 and 3, plus the
    # residual and the sum forward, the sum's gradient backward); their measurements become
    # entries of their own, and the borrowed entries stay for the rest
    import json

    import codegen.schedule
    from benchmarks.tune import write_table

    m, n, size = 64, 1024, 2
    x, p = m * n * size, n * size
    assert tune._moved(tune._op("add_layernorm"), "fwd", m, n, size) == 4 * x + 2 * p
    assert tune._moved(tune._op("add_layernorm"), "bwd", m, n, size) == 4 * x + 3 * p
    assert tune._moved(tune._op("add_rmsnorm"), "fwd", m, n, size) == 4 * x + p
    assert tune._moved(tune._op("add_rmsnorm"), "bwd", m, n, size) == 4 * x + 2 * p
    result = _result(4096, "torch.bfloat16", [_config(2, 2, 2000), _config(4, 4, 1900)], n=1024)
    result |= {"op": "add_rmsnorm", "mode": "fwd"}
    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [result]}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    table = json.loads(codegen.schedule.MEASURED_TABLE.read_text())
    table["ops"].pop("add_rmsnorm", None)
    (tmp_path / "table.json").write_text(json.dumps(table))
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    written = json.loads(write_table([tmp_path / "tune.json"], "test").read_text())
    assert written["ops"]["add_rmsnorm"] == {"fwd": {"1024": [2, 2, 0, 1, 0]}}
    assert written["borrow"]["add_rmsnorm"] == "rmsnorm"
    entries = {(kind, width): config for kind, width, config in
               codegen.schedule.ScheduleTable(measured_table=written).measured("add_rmsnorm")}
    assert entries[("fwd", 1024)][:5] == (2, 2, 0, 1, 0)
    rmsnorm_bwd = written["ops"]["rmsnorm"]["bwd"]["1024"]
    assert list(entries[("bwd", 1024)][:len(rmsnorm_bwd)]) == rmsnorm_bwd


def test_forms_of_a_borrowed_entry_are_filed_under_the_op_it_came_from(tmp_path, monkeypatch):
    import json

    import codegen.schedule
    from benchmarks.tune import write_table

    table = json.loads(codegen.schedule.MEASURED_TABLE.read_text())
    table["ops"]["add_layernorm"] = {"fwd": {"4096": [1, 8, 0, 1, 0]}}
    (tmp_path / "table.json").write_text(json.dumps(table))
    monkeypatch.setattr(codegen.schedule, "MEASURED_TABLE", tmp_path / "table.json")
    borrowed = table["ops"]["layernorm"]["fwd"]["2048"]
    held = (borrowed + list(tune.ENTRY_DEFAULTS)[len(borrowed):])[:6]
    records = [_forms(["fwd", 4096], [1, 8, 0, 1, 0, -1], (1000, 1000, 1100, 1000)),
               _forms(["fwd", 2048], held, (1000, 1000, 1100, 1000))]
    for record in records:
        record["op"] = "add_layernorm"
    report = {"device": "test", "sms": 1, "torch": "t", "triton": "t", "date": "d",
              "results": [], "forms": records}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    written = json.loads(write_table([tmp_path / "tune.json"], "forms").read_text())["ops"]
    assert written["add_layernorm"]["fwd"] == {"4096": [1, 8, 0, 1, 0, -1, 2]}
    assert written["layernorm"]["fwd"]["2048"] == [*held, 2]


def test_the_masked_softmax_is_measured_as_attention_runs_it():
    # tune --ops masked_softmax times its launchers with attention's mask, scale and dropout and
    # charges 3 activation-sized tensors each way (x, y, p forward; dy, p, dx backward); the
    # calls are the public op's (same seed: same dropout mask, same gradient)
    from benchmarks.sweep import MASKED_SOFTMAX, _masked_softmax_calls
    from generated import masked_softmax

    m, n, size = 64, 1024, 2
    x = m * n * size
    assert tune._moved(tune._op("masked_softmax"), "fwd", m, n, size) == 3 * x
    assert tune._moved(tune._op("masked_softmax"), "bwd", m, n, size) == 3 * x
    m, n = 48, 16
    forward, backward, element_size = _masked_softmax_calls(masked_softmax, m, n, torch.float32,
                                                            device="cpu")
    y, p = forward()
    dx, = backward()
    generator = torch.Generator("cpu").manual_seed(0)
    inputs = torch.randn((m // n, 1, n, n), generator=generator).requires_grad_()
    dy = torch.randn((m, n), generator=generator)
    mask = torch.zeros((m // n, 1, 1, n))
    mask[..., -n // 8:] = float("-inf")
    expected = masked_softmax.masked_softmax(inputs, mask, seed=0, **MASKED_SOFTMAX)
    expected.backward(dy.reshape(inputs.shape))
    assert element_size == 4
    torch.testing.assert_close(y, expected.detach().reshape(m, n))
    torch.testing.assert_close(dx, inputs.grad.reshape(m, n))
    assert (p[:, -n // 8:] == 0).all() and torch.allclose(p.sum(1), torch.ones(m))


def test_the_used_schedule_is_the_rule_s_under_the_constants_in_force():
    """`tune._used_schedule` asks the module's rule through `SCHEDULES.override(choose=...)`:
    it sees the constants and the table in force (here split rows off, as tune measures), and
    leaves the module's choice as it was."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(4, 64, device=device)

    def call():
        return softmax._softmax_fwd(x)

    chosen = softmax.SCHEDULES.choose(4, 64, False, "fwd", 1, 4, device)
    assert tune._used_schedule(softmax, call) == chosen
    with softmax.SCHEDULES.override(max_rows=2):
        assert tune._used_schedule(softmax, call).rows == 2
    assert softmax.SCHEDULES.choose(4, 64, False, "fwd", 1, 4, device) == chosen
