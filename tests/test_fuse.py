"""codegen/fuse.py: which passes of a looped row share one sweep, and which must not."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import sympy
import torch
from reference import force_looped, randn, select_path

from codegen.fuse import Moments, OnlineExp, OnlineFirst, OnlineGap, picks, sweeps
from codegen.ir import Assign, Kernel, Pass, RowReduce, Store, Tensor
from codegen.lower import lower
from derive.engine import derive, load_spec
from generated import add_layernorm, cross_entropy, layernorm, masked_softmax, softmax

ROOT = Path(__file__).resolve().parent.parent
x, m, s, n = (sympy.Symbol(name, real=True) for name in ("x", "m", "s", "N"))
k = sympy.Symbol("k", integer=True)


def kernels(op: str) -> dict[str, Kernel]:
    derivation = derive(load_spec(ROOT / "derive" / "ops" / f"{op}.py", f"{op}.py"))
    found = {"fwd": lower(derivation.forward, "fwd", derivation.saved_outputs)}
    found |= {mode: lower(result.graph, mode) for mode, result in derivation.backwards.items()}
    return found


def two_passes(first: RowReduce, second: RowReduce) -> Kernel:
    return Kernel("k", (Tensor("x", "element"),), (Tensor("y", "row"),), (), (),
                  (Pass(("x",), (), (first,), ()), Pass(("x",), (), (second,), ())),
                  Pass((), (), (), ()), (Store("y", s, "row"),))


MEAN = RowReduce("m", "sum", x, 1 / n)
PEAK = RowReduce("m", "max", x, sympy.Integer(1))


def test_layernorm_variance_joins_the_mean():
    (sweep,) = sweeps(kernels("layernorm")["fwd"])
    assert sweep.joined == (1, 2)
    (pair,) = sweep.fused
    assert isinstance(pair, Moments) and (pair.mean.name, pair.second.name) == ("mean", "var")


@pytest.mark.parametrize("op", ["softmax", "masked_softmax", "cross_entropy"])
def test_exp_sum_joins_the_max(op):
    # as the Triton kernels see it: cross-entropy's target logit read as one element a row
    (sweep,) = sweeps(picks(kernels(op)["fwd"])[0])
    pair, *riders = sweep.fused
    assert isinstance(pair, OnlineExp) and pair.peak.name == "row_max" and pair.factor == 1
    # cross-entropy's gaps below that max (its smoothing term) and predicted class, the first
    # column at that max, ride on it too
    assert [(type(r), r.peak.name, r.total.name if isinstance(r, OnlineGap) else r.first.name)
            for r in riders] == (
        [(OnlineGap, "row_max", "max_gap"), (OnlineFirst, "row_max", "first_max")]
        if op == "cross_entropy" else [])
    # the mean class weight of the first pass stays a plain accumulator of the joined sweep
    assert {r.name for r in sweep.reductions} == (
        {"weight_mean"} if op == "cross_entropy" else set())


def test_recomputed_mean_in_a_backward_keeps_its_pass():
    # sum_j(dy * weight * rstd * (x - mean)) is linear in the mean, but expanding it would
    # cancel (sum dy*w*x - mean * sum dy*w): not a shape carried here
    kernel = kernels("layernorm")["recompute_mean"]
    assert [sweep.joined for sweep in sweeps(kernel)] == [(1,), (2,)]


@pytest.mark.parametrize(("first", "second", "carried"), [
    (MEAN, RowReduce("s", "sum", (x - m) ** 2, 1 / n), Moments),
    (MEAN, RowReduce("s", "sum", (x - m) ** 2, sympy.Integer(1)), Moments),
    (MEAN, RowReduce("s", "sum", (x - m) ** 3, 1 / n), None),
    (MEAN, RowReduce("s", "sum", (2 * x - m) ** 2, 1 / n), None),
    (RowReduce("m", "sum", x, sympy.Integer(1)), RowReduce("s", "sum", (x - m) ** 2, 1 / n), None),
    (MEAN, RowReduce("s", "sum", sympy.exp(x - m), sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "sum", sympy.exp(x - m), sympy.Integer(1)), OnlineExp),
    (PEAK, RowReduce("s", "sum", x * sympy.exp(x - m), sympy.Integer(1)), OnlineExp),
    (PEAK, RowReduce("s", "sum", sympy.exp(2 * x - m), sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "sum", sympy.exp(x - 2 * m), sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "max", sympy.exp(x - m), sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "sum", (x - m) ** 2, 1 / n), None),
    # the first column at the max: an argmax
    (PEAK, RowReduce("s", "min", sympy.Piecewise((k, x >= m), (n, True)), sympy.Integer(1)),
     OnlineFirst),
    (PEAK, RowReduce("s", "min", sympy.Piecewise((k, x > m), (n, True)), sympy.Integer(1)),
     None),
    (PEAK, RowReduce("s", "min", sympy.Piecewise((k, 2 * x >= m), (n, True)),
                     sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "min", sympy.Piecewise((k * m, x >= m), (n, True)),
                     sympy.Integer(1)), None),
    (MEAN, RowReduce("s", "min", sympy.Piecewise((k, x >= m), (n, True)), sympy.Integer(1)),
     None),
    # sums affine in the max: the gaps below it, weighted or not
    (PEAK, RowReduce("s", "sum", m - x, 1 / n), OnlineGap),
    (PEAK, RowReduce("s", "sum", x * (m - x) + 3 * m, sympy.Integer(1)), OnlineGap),
    (PEAK, RowReduce("s", "sum", (m - x) ** 2, sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "sum", m * m - x, sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "sum", sympy.Abs(m - x), sympy.Integer(1)), None),
    (PEAK, RowReduce("s", "sum", x, sympy.Integer(1) / m), None),
    (MEAN, RowReduce("s", "sum", m - x, 1 / n), None),
])
def test_only_carried_shapes_join(first, second, carried):
    found = sweeps(two_passes(first, second))
    if carried is None:
        assert [sweep.joined for sweep in found] == [(1,), (2,)]
    else:
        (sweep,) = found
        assert [type(pair) for pair in sweep.fused] == [carried]


def test_second_pass_using_a_row_value_of_the_first_keeps_its_pass():
    first = Pass(("x",), (), (MEAN,), (Assign("r", 2 * m, "row"),))
    scaled = RowReduce("s", "sum", (x - m) ** 2 * sympy.Symbol("r"), sympy.Integer(1))
    second = Pass(("x",), (), (scaled,), ())
    kernel = Kernel("k", (Tensor("x", "element"),), (Tensor("y", "row"),), (), (),
                    (first, second), Pass((), (), (), ()), (Store("y", s, "row"),))
    assert [sweep.joined for sweep in sweeps(kernel)] == [(1,), (2,)]


@pytest.mark.parametrize("module", [layernorm, softmax, masked_softmax, cross_entropy])
def test_looped_forward_has_the_joined_sweep_and_the_passes(module):
    # the generated looped forward: under ONE_SWEEP one sweep for the statistics, else two;
    # then one writing the output (cross-entropy writes none)
    source = inspect.getsource(getattr(module, f"_{module.__name__.split('.')[-1]}_fwd_red").fn)
    one, two = source.split("if ONE_SWEEP:")[1].split("        else:\n", 1)
    assert one.count("for chunk in") == 1
    writes = module is not cross_entropy
    assert two.count("for chunk in") == 2 + writes


def _calls(device):
    x = randn((5, 37), device=device, shift=2.0) * 3
    w, b = randn((37,), seed=1, device=device), randn((37,), seed=2, device=device)
    mask = torch.zeros(5, 37, device=device, dtype=x.dtype)
    mask[:, :20] = -float("inf")  # the first column blocks of some rows see only -inf
    mask[0] = 0.0
    target = torch.tensor([0, 36, 5, 17, 2], device=device)
    return {
        layernorm: lambda: layernorm.layer_norm(x, (37,), w, b),
        add_layernorm: lambda: add_layernorm.add_layer_norm(x, x.flip(0), (37,), w, b),
        softmax: lambda: softmax.softmax(x + torch.arange(37, device=device) * 2.0),
        masked_softmax: lambda: masked_softmax.masked_softmax(x, mask, scale=0.5),
        # a max that grows from block to block: the gaps below it move with it (and the
        # weights make their slopes differ from lane to lane)
        cross_entropy: lambda: cross_entropy.cross_entropy(
            x + torch.arange(37, device=device) * 0.5, target, weight=w.abs() + 0.5,
            label_smoothing=0.1, reduction="none"),
    }


@pytest.mark.parametrize("module", [layernorm, add_layernorm, softmax, masked_softmax,
                                    cross_entropy], ids=lambda m: m.__name__.split(".")[-1])
def test_one_sweep_equals_a_pass_each(monkeypatch, module):
    # fp64: the running forms (Welford, online max) agree with the passes they replace to
    # rounding, and so do both with every other sweep run backwards (REVERSE: after one sweep
    # the epilogue runs backwards, after two passes the second); the conftest's looped schedule
    # runs the one-sweep form everywhere else. The Triton path only: the torch path has no sweeps
    results = []
    for one_sweep in (True, False):
        for reverse in (False, True):
            monkeypatch.undo()
            device = select_path(monkeypatch, "triton")
            with force_looped(module, one_sweep, reverse):
                out = _calls(device)[module]()
            results.append([t for t in (out if isinstance(out, tuple) else (out,))])
    for other in results[1:]:
        for first, got in zip(results[0], other, strict=True):
            torch.testing.assert_close(got, first, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_cross_entropy_target_logit_is_read_as_one_element():
    # and the target's class weight, a column value, as one element of the weights
    kernel, found = picks(kernels("cross_entropy")["fwd"])
    logit, weight = found
    # the capped logit at the target, computed from the one logit read there
    softcap = sympy.Symbol("softcap", real=True)
    capped = sympy.Piecewise((x, sympy.Eq(softcap, 0)), (softcap * sympy.tanh(x / softcap), True))
    assert (logit.name, logit.index, logit.body, logit.loads, logit.columns) == (
        "target_logit", "target", capped, ("x",), ())
    assert (weight.name, weight.index, weight.loads, weight.columns) == (
        "target_weight", "target", (), ("weight",))
    assert {r.name for p in kernel.passes for r in p.reductions} == {
        "row_max", "denominator", "max_gap", "weight_mean", "first_max"}


def one_hot_sum(body: sympy.Expr, index: sympy.Symbol, extra=()) -> Kernel:
    key, target = sympy.Symbol("key", integer=True), sympy.Symbol("t", integer=True)
    onehot = RowReduce("picked", "sum", sympy.Piecewise((body, sympy.Eq(key, index)), (0, True)),
                       sympy.Integer(1))
    return Kernel("k", (Tensor("x", "element"), Tensor("t", "row", integer=True), *extra),
                  (Tensor("y", "row"),), (), (),
                  (Pass(("x", "key"), (), (onehot, MEAN), ()),), Pass((), (), (), ()),
                  (Store("y", s, "row"),), generated=(("key", "column_index"),)), target


def test_one_hot_sums_that_are_not_one_element_stay_sums():
    kernel, target = one_hot_sum(sympy.exp(x), sympy.Symbol("t", integer=True))
    assert [p.name for p in picks(kernel)[1]] == ["picked"]
    # an index that is not an integer row input (a float row value): kept
    kernel, _ = one_hot_sum(x, sympy.Symbol("r", real=True), (Tensor("r", "row"),))
    assert picks(kernel)[1] == ()
    # a body that varies with the column other than through element inputs: kept
    kernel, _ = one_hot_sum(x * sympy.Symbol("key", integer=True), target)
    assert picks(kernel)[1] == ()


def test_sums_that_vanish_where_masked_skip_the_select():
    from codegen.emit import KernelFacts, TritonKernel

    backward = TritonKernel(KernelFacts(kernels("layernorm")["default"]))
    # dy loads as 0 where the mask is off, so dy * (weight + weight_offset) * x_hat is 0
    # there: no select
    reductions = {r["name"]: r for p in backward.passes for r in p["reductions"]}
    assert not reductions["sum_dy_x_hat_weight_weight_offset"]["masked"].startswith("tl.where")
    assert not {s["name"]: s for s in backward.column_stores}["dweight"]["masked"].startswith(
        "tl.where")
    # exp(x - row_max) is exp(-row_max) there, not 0: the select stays
    forward = TritonKernel(KernelFacts(kernels("softmax")["fwd"]))
    reductions = {r["name"]: r for p in forward.passes for r in p["reductions"]}
    assert reductions["denominator"]["masked"].startswith("tl.where(mask")


def test_every_other_sweep_runs_backwards_under_reverse():
    from codegen.emit import KernelFacts, TritonKernel

    def directions(context):
        lines = [line.strip() for line in context.sweep_lines()]
        return [line.split(" = ", 1)[1].split(" * BLOCK_N")[0] for line in lines
                if line.startswith("cols = ")], context.epilogue_columns_lines()[-1]

    # the layer-norm forward: one joined sweep (forwards: Welford counts steps from the first
    # column block) or the mean's and the variance's passes (the second backwards); the
    # epilogue backwards after the one sweep, forwards after the two
    sweeps, epilogue = directions(TritonKernel(KernelFacts(kernels("layernorm")["fwd"])))
    assert sweeps == ["chunk", "chunk", "helpers.column_block(chunk, CHUNKS, REVERSE)"]
    assert epilogue.startswith("cols = helpers.column_block(chunk, CHUNKS, REVERSE * ONE_SWEEP) ")
    # the layer-norm backward: one sweep for both sums, then the epilogue backwards
    sweeps, epilogue = directions(TritonKernel(KernelFacts(kernels("layernorm")["default"])))
    assert sweeps == ["chunk"]
    assert epilogue.startswith("cols = helpers.column_block(chunk, CHUNKS, REVERSE) ")


def test_a_sweep_s_direction_follows_the_parity_of_the_sweeps_before_it():
    from codegen.emit import KernelFacts, TritonKernel

    # (sweeps before it with ONE_SWEEP set, without): forwards, backwards, or by ONE_SWEEP
    assert TritonKernel._backwards(2, 2) == "0"
    assert TritonKernel._backwards(1, 3) == "1"
    assert TritonKernel._backwards(1, 2) == "ONE_SWEEP"
    assert TritonKernel._backwards(2, 3) == "(1 - ONE_SWEEP)"

    context = TritonKernel(KernelFacts(kernels("layernorm")["fwd"]))
    assert context.columns_lines("0") == [
        "cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]"]
    assert context.columns_lines("(1 - ONE_SWEEP)") == [
        "cols = helpers.column_block(chunk, CHUNKS, REVERSE * (1 - ONE_SWEEP)) * BLOCK_N"
        " + tl.arange(0, BLOCK_N)[None, :]"]
    # a kernel that draws random values names the block's first column for `helpers.uniform`
    seeded = TritonKernel(KernelFacts(kernels("bias_dropout_add")["fwd"]))
    assert seeded.columns_lines("1") == [
        "col0 = helpers.column_block(chunk, CHUNKS, REVERSE) * BLOCK_N",
        "cols = col0 + tl.arange(0, BLOCK_N)[None, :]"]
