"""codegen/fuse.py: which passes of a looped row share one sweep, and which must not."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import sympy

from codegen.fuse import Moments, OnlineExp, sweeps
from codegen.ir import Assign, Kernel, Pass, RowReduce, Store, Tensor
from codegen.lower import lower
from derive.engine import derive, load_spec
from generated import cross_entropy, layernorm, masked_softmax, softmax

ROOT = Path(__file__).resolve().parent.parent
x, m, s, n = (sympy.Symbol(name, real=True) for name in ("x", "m", "s", "N"))


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
    (sweep,) = sweeps(kernels(op)["fwd"])
    (pair,) = sweep.fused
    assert isinstance(pair, OnlineExp) and pair.peak.name == "row_max" and pair.factor == 1
    # cross-entropy's other reductions of the first pass stay plain accumulators
    assert {r.name for r in sweep.reductions} == (
        {"target_logit", "logit_mean"} if op == "cross_entropy" else set())


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
def test_looped_forward_reads_each_row_once_per_sweep(module):
    # the generated looped forward: one sweep for the statistics (+ one writing the output)
    source = inspect.getsource(getattr(module, f"_{module.__name__.split('.')[-1]}_fwd_red").fn)
    writes = module is not cross_entropy
    assert source.count("for chunk in") == 1 + writes
