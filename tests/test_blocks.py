"""The block-spec language (derive/blocks.py) and its printer and renderer (codegen/layers.py):
exact strings for expressions and wrapped calls, spec errors that point at the spec line,
checkpoint regions' inputs and outputs, and a tiny block rendered, executed and differentiated."""

from __future__ import annotations

import pytest
import torch
from reference import randn

from codegen.layers import PRINT, LayerContext, call_lines, render_layer
from derive.blocks import (
    LINEAR,
    TRAINING,
    Attr,
    BlockSpec,
    Const,
    Pack,
    Select,
    Value,
    check_ops,
    op,
)
from derive.spec import SpecError

HERE = __file__


@pytest.mark.parametrize(("expr", "source"), [
    (Attr("a") + Attr("b") * 3, "self.a + self.b * 3"),
    ((Attr("a") + Attr("b")) * 3, "(self.a + self.b) * 3"),
    (Attr("a") - (Attr("b") - Attr("c")), "self.a - (self.b - self.c)"),
    (Attr("h") // Attr("n") ** -0.5, "self.h // self.n ** -0.5"),
    ((Attr("h") // Attr("n")) ** -0.5, "(self.h // self.n) ** -0.5"),
    (TRAINING & Attr("p").greater(0), "self.training and self.p > 0"),
    (~(Attr("a") & Attr("b")), "not (self.a and self.b)"),
    ((Attr("h") % Attr("n")).greater(0), "self.h % self.n > 0"),
    (Attr("kind").equals("sdpa"), 'self.kind == "sdpa"'),
    (Select(Attr("flag"), "invertible", "default"), '"invertible" if self.flag else "default"'),
    (Select(TRAINING, Attr("p"), 0.0), "self.p if self.training else 0.0"),
    (Pack((Attr("h"),)), "(self.h,)"),
    (Pack((Value("x"), Const(None), Const(-1))), "(x, None, -1)"),
])
def test_printer(expr, source):
    assert PRINT(expr) == source


def test_long_calls_fill_continuation_lines():
    assert call_lines("y", "f", ["a", "b"], "    ") == ["    y = f(a, b)"]
    arguments = [f"argument_{i}" for i in range(12)]
    lines = call_lines("out", "module.function", arguments, "        ")
    assert lines[0] == "        out = module.function("
    assert lines[-1] == "        )"
    assert all(len(line) <= 100 for line in lines)
    assert " ".join(lines[1:-1]).split() == [f"{a}," for a in arguments]


def small_block(checkpointed: bool = True) -> BlockSpec:
    """y = linear(gelu-free MLP): h = x W1^T; z = h W2^T (optionally recomputed); y = z + x."""
    b = BlockSpec("tiny", "Tiny", doc="A two-GEMM block.")
    width = b.size("width", "features")
    recompute = b.flag("recompute", False, "checkpoint the second GEMM")
    init = b.positive("std", 0.5, "init std")
    w1 = b.param("w1", (2 * width, width), "normal", "first", std=init)
    w2 = b.param("w2", (width, 2 * width), "normal", "second", std=init)
    scale = b.param("scale", (width,), "ones", "output scale")
    x = b.input("x", "(..., width)")
    h = b.call(LINEAR, x, w1, out="h")
    if checkpointed:
        with b.checkpoint("_second", recompute, "the second GEMM, then a ReLU-free square"):
            z = b.call(LINEAR, h, w2, out="z")
            zz = b.call(op("mul", "mul"), z, z, out="zz")
    else:
        zz = b.call(LINEAR, h, w2, out="zz")
    y = b.call(op("mul", "mul"), zz, scale, out="y")
    b.output(y, "(..., width)")
    b.source = "tests/test_blocks.py"
    b.finish()
    return b


def test_checkpoint_region_takes_what_it_reads_and_returns_what_is_read_later():
    region = LayerContext(small_block()).regions["_second"]
    assert (region.inputs, region.outputs) == (["h"], ["zz"])
    assert region.call_lines("    ") == [
        "    if self.recompute:",
        "        zz = checkpoint(self._second, h, use_reentrant=False)",
        "    else:",
        "        zz = self._second(h)"]


def test_rendered_block_runs_and_checkpointing_changes_nothing():
    block = small_block()
    # a generated op stands for any function of a module: point `mul` at torch's
    source = render_layer(block).replace("from generated import mul", "import torch as mul")
    namespace: dict = {}
    exec(compile(source, "tiny.py", "exec"), namespace)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        layer = namespace["Tiny"](4, recompute=recompute, dtype=torch.float64)
        x = randn((3, 4)).requires_grad_()
        layer(x).sum().backward()
        grads.append([x.grad, *(p.grad for p in layer.parameters())])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
    assert repr(namespace["Tiny"](4, std=0.25)) == "Tiny(width=4, std=0.25)"
    with pytest.raises(ValueError, match=r"Tiny\(\): argument 'width' must be > 0, got 0"):
        namespace["Tiny"](0)


def test_check_ops_names_the_missing_op_and_the_spec_line():
    with pytest.raises(SpecError, match=r"test_blocks.py:\d+: no op spec derive/ops/mul.py"):
        check_ops(small_block(), {"layernorm": "layer_norm"})
    with pytest.raises(SpecError, match="op 'mul' has the API function 'multiply', not 'mul'"):
        check_ops(small_block(), {"mul": "multiply"})


def spec_error(build) -> str:
    with pytest.raises(SpecError) as info:
        build(BlockSpec("bad", "Bad"))
    message = str(info.value)
    assert message.startswith(f"{HERE}:"), f"{message!r} does not point at the spec line"
    return message


def test_spec_errors_point_at_the_spec_line():
    def undefined(b):
        b.call(LINEAR, Value("nowhere"), out="y")

    def twice(b):
        x = b.input("x", "")
        b.call(LINEAR, x, out="y")
        b.call(LINEAR, x, out="y")

    def nested(b):
        flag = b.flag("f", False, "")
        x = b.input("x", "")
        with b.checkpoint("_outer", flag, ""), b.checkpoint("_inner", flag, ""):
            b.call(LINEAR, x, out="y")

    def not_a_flag(b):
        size = b.size("n", "")
        with b.checkpoint("_region", size, ""):
            pass

    def required_after_default(b):
        b.flag("f", False, "")
        b.size("n", "")

    def reserved(b):
        b.input("training", "")

    def normal_without_std(b):
        b.param("w", (2,), "normal", "")

    assert "value 'nowhere' is used before it is defined" in spec_error(undefined)
    assert "value 'y' is assigned twice" in spec_error(twice)
    assert "checkpoint regions do not nest" in spec_error(nested)
    assert "'n' is not a flag option" in spec_error(not_a_flag)
    assert "required option 'n' follows one with a default" in spec_error(required_after_default)
    assert "'training' is reserved" in spec_error(reserved)
    assert "init is 'ones', 'zeros' or 'normal' with a std" in spec_error(normal_without_std)


def test_branch_cases_may_each_define_a_value_and_dead_values_are_errors():
    b = BlockSpec("branchy", "Branchy")
    flag = b.flag("f", False, "")
    x = b.input("x", "")
    with b.branch() as branch:
        with branch.when(flag):
            b.call(LINEAR, x, out="y")
        with branch.otherwise():
            b.call(LINEAR, x, x, out="y")
    b.output(b.value("y"), "")
    b.source = "branchy"
    b.finish()
    assert LayerContext(b).forward == [
        "        if self.f:", "            y = F.linear(x)",
        "        else:", "            y = F.linear(x, x)"]

    dead = BlockSpec("dead", "Dead")
    x = dead.input("x", "")
    dead.call(LINEAR, x, out="unused")
    dead.output(dead.call(LINEAR, x, out="y"), "")
    with pytest.raises(SpecError, match="value 'unused' is computed but never used"):
        dead.finish()
