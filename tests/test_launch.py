"""The direct launch (launch plans in every generated module): a CUDA call keyed as Triton would
specialize it launches the kernel compiled for an earlier such call without the JIT's binding.
Launchers key by their inputs, `codegen.runtime.launch.launch` by its kernel's arguments and
`codegen.runtime.launch.column_sums` by its shapes and result dtypes. A key must
tell apart every call Triton compiles apart, or a kernel compiled for aligned addresses or for
M == 1 would run where they do not hold."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
from reference import HAS_CUDA, force_looped
from test_cuda_graphs import NAMES, _cases, _step

import generated.layernorm as layernorm
import generated.rmsnorm as rmsnorm
from codegen.runtime import launch
from codegen.runtime.schedules import forget_all


def test_key_tells_apart_what_triton_compiles_apart():
    """Triton compiles apart ints that are 1, multiples of 16, or past int32; tensors of other
    dtypes or not 16-byte aligned; None, bools. The key must be at least as fine (floats, all
    passed as fp32, may share one)."""
    def key(*args):
        return tuple(launch.specializations(args))

    for a, b in ((1, 2), (2, 16), (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16), (None, 0),
                 (True, False)):
        assert key(a) != key(b), (a, b)
    assert key(1e-5) == key(0.5) and key(1e-5) != key(None)
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert key(x) == key(x[8:]) and key(x) != key(x[1:]) and key(x) != key(x.float())
    parameter = torch.nn.Parameter(x[1:])  # a subclass: keyed as the tensor it is
    assert key(parameter) == key(x[1:])
    assert key(x, 3, 1e-5) != key(x, 4, 1e-5) and key(x, 3, 1e-5) == key(x[8:], 3, 0.1)


def test_launch_hooks_keep_the_jit_path():
    """Profilers hook launches: a set hook, or a chain holding one (triton 3.6+ keeps chains,
    never None, so an empty chain must not count as a hook)."""
    hooked = launch._hooked
    assert not hooked(None) and hooked(print)
    chain = getattr(getattr(triton, "knobs", None), "runtime", None)
    if chain is not None and hasattr(chain.launch_enter_hook, "calls"):
        fresh = type(chain.launch_enter_hook)()
        assert not hooked(fresh)
        fresh.add(print)
        assert hooked(fresh)


def _three_flags_source(x_ptr, n, A: triton.language.constexpr, B: triton.language.constexpr,
                        C: triton.language.constexpr):
    pass


#: a JITFunction itself (triton.jit gives an interpreted function under TRITON_INTERPRET=1)
_three_flags = triton.runtime.JITFunction(_three_flags_source)


class _Compiled:
    """What `make_plan` reads of a compiled kernel: its launcher and metadata."""

    function, packed_metadata = "function", "metadata"

    class run:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        @staticmethod
        def launch(*args):
            return args

    run = run()


def test_plan_passes_constexprs_in_signature_order():
    """A call may name its constexprs in any order; the launcher takes them positionally in the
    kernel's signature order, so the plan must reorder them (a plan that kept the call's order,
    or none at all, sent every later call through the JIT's slow path)."""
    plan = launch.make_plan(None, _three_flags, _Compiled(), (4,), 2, {"C": 3, "A": 1, "B": 2})
    assert plan is not None and plan.tail == (1, 2, 3)
    for wrong in ({"A": 1, "B": 2}, {"A": 1, "B": 2, "D": 4}, {"A": 1, "B": 2, "C": 3, "D": 4}):
        assert launch.make_plan(None, _three_flags, _Compiled(), (4,), 2, wrong) is None, wrong


pytestmark_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the direct launch is CUDA's")


def _jit_calls(monkeypatch):
    """A counter of launches through Triton's JIT (JITFunction.run)."""
    calls = []
    run = triton.runtime.JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.JITFunction, "run", counted)
    return calls


@pytestmark_cuda
def test_repeated_calls_launch_directly(monkeypatch):
    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        y = layernorm.layer_norm(x, (1024,), w, b)
        return (y, *torch.autograd.grad(y, (x, w, b), dy))

    layernorm.SCHEDULES.forget()
    launch.SUM_PLANS.clear()
    first = step()  # through the JIT (compiling or not), which keys the launches
    calls = _jit_calls(monkeypatch)
    again = step()
    assert calls == [], f"launched through the JIT again: {calls}"
    for got, want in zip(again, first, strict=True):
        assert torch.equal(got, want), "the direct launch computed other values than the JIT's"
    # the op's forward and backward plans, and the column sums' (one launch for both sums)
    assert len(layernorm.SCHEDULES.plans) == 2, layernorm.SCHEDULES.plans
    assert len(launch.SUM_PLANS) == 1, launch.SUM_PLANS
    plans = [*layernorm.SCHEDULES.plans.values(), *launch.SUM_PLANS.values()]
    if launch._C_LAUNCH:  # triton 3.6: the C launcher itself, not its Python wrapper
        assert all(plan.launch.__class__.__name__ == "builtin_function_or_method" for plan in plans)


@pytestmark_cuda
@pytest.mark.parametrize("rows", [1, 2, 17, 64])
def test_misaligned_and_one_row_calls_compile_their_own(monkeypatch, rows):
    """After aligned calls, the same shapes at an odd address (and M == 1, a constant to
    Triton) must not run the kernel compiled for the aligned ones."""
    N = 1000  # a padded row (masks); rows 2000 bytes apart: a shifted start shifts every row
    w = torch.randn(N, device="cuda")
    base = torch.randn(rows * N + 8, device="cuda", dtype=torch.float16)
    aligned = base[:rows * N].view(rows, N)
    shifted = base[1:rows * N + 1].view(rows, N)  # 2 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 != 0
    layernorm.SCHEDULES.forget()
    for x in (aligned, shifted, aligned, shifted):
        for call in (lambda x: layernorm.layer_norm(x, (N,), w),
                     lambda x: rmsnorm.rms_norm(x, (N,), w, 1e-6)):
            # a kernel compiled for aligned rows would misread the shifted ones: the same
            # values from an aligned copy must come out exactly the same
            assert torch.equal(call(x), call(x.clone()))
    keys = [key for key in layernorm.SCHEDULES.plans if key[0] == "_layernorm_fwd"]
    assert len(keys) == 2, keys  # the aligned and the shifted input keyed apart


@pytestmark_cuda
@pytest.mark.parametrize("name", NAMES)
def test_every_op_launches_directly(monkeypatch, name):
    """Every generated launcher's kernels (forward, backward, column sums) take the direct path
    from their second call on: each passes its constexprs by name in signature order."""
    generator = torch.Generator("cuda").manual_seed(3)
    cases, params = _cases(64, 1024, generator)
    fn, inputs = cases[name]
    with torch.no_grad():
        outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]
    _step(fn, inputs, params, grads)
    calls = _jit_calls(monkeypatch)
    _step(fn, inputs, params, grads)
    assert calls == [], f"{name}: launched through the JIT again: {calls}"


def test_forgetting_drops_plans_and_chosen_schedules():
    """`SCHEDULES.forget` empties the op's launch plans and the schedules it chose; `override`
    forgets both on entry and on exit, so that nothing chosen or planned within the block (where
    benchmarks.tune fixes the schedule with `choose`) is launched after it; `forget_all`
    reaches every op."""
    seam = layernorm.SCHEDULES
    cpu = torch.device("cpu")
    ruled = []

    def counted(*args):
        ruled.append(args)
        return seam.rule(*args)

    seam.keep(("before",), "plan")
    with seam.override(choose=counted):
        assert seam.plans == {}  # forgotten on entry
        for _ in range(2):
            seam.choose(64, 1024, False, "fwd", 1, 2, cpu)
        assert len(ruled) == 1  # chosen once, then kept
        seam.keep(("key",), "plan")
        seam.keep(None, "plan")  # a launch that cannot be planned keeps nothing
        assert seam.plans == {("key",): "plan"}
        seam.forget()
        assert seam.plans == {}
        seam.choose(64, 1024, False, "fwd", 1, 2, cpu)
        assert len(ruled) == 2  # chosen again after forget
        seam.keep(("key",), "plan")
    assert seam.plans == {}  # forgotten on exit
    seam.choose(64, 1024, False, "fwd", 1, 2, cpu)
    assert len(ruled) == 2  # the replaced rule is gone with the block
    seam.keep(("key",), "plan")
    rmsnorm.SCHEDULES.keep(("key",), "plan")
    forget_all()
    assert seam.plans == {} and rmsnorm.SCHEDULES.plans == {}


def test_a_forced_schedule_is_launched_after_a_plan(monkeypatch):
    """A schedule forced after calls of the same shape (force_looped, benchmarks.sweep and tune)
    is the one launched: the plans made before are forgotten (on CUDA the second call would
    otherwise launch the whole-row kernel of the first)."""
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 8192 + 64, device=device)
    whole = layernorm.layer_norm(x, (x.shape[1],))
    layernorm.layer_norm(x, (x.shape[1],))  # from here on a CUDA call of this shape has a plan
    launched = []
    kernel = type(layernorm._layernorm_fwd_red)  # Triton's JIT or interpreter kernel class
    run = kernel.run

    def recorded(self, *args, **kwargs):
        launched.append(self.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(kernel, "run", recorded)
    with force_looped(layernorm):
        forced = layernorm.layer_norm(x, (x.shape[1],))
    assert launched == ["_layernorm_fwd_red"], "the plan of the whole-row call was launched"
    torch.testing.assert_close(forced, whole)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="two CUDA devices")
@pytest.mark.parametrize("name", NAMES)
def test_tensors_on_another_device_than_the_current(name):
    """Tensors on cuda:1 while cuda:0 is current: every op runs on its tensors' device, as
    torch's own ops do, and computes bit for bit what it does with cuda:1 current (Triton
    compiles for and launches on the current device; each launcher makes it the tensors')."""
    with torch.cuda.device(1):
        generator = torch.Generator("cuda").manual_seed(3)
        cases, params = _cases(64, 1024, generator)
        fn, inputs = cases[name]
        with torch.no_grad():
            outputs = fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grads = [torch.randn_like(o) for o in outputs]
        want_outputs, want_grads = _step(fn, inputs, params, grads)
        want_outputs = [o.detach().clone() for o in want_outputs]
        want_grads = [None if g is None else g.clone() for g in want_grads]
    with torch.cuda.device(0):
        got_outputs, got_grads = _step(fn, inputs, params, grads)
    torch.cuda.synchronize(1)
    for got, want in zip((*got_outputs, *got_grads), (*want_outputs, *want_grads), strict=True):
        if want is None:
            assert got is None
            continue
        assert got.device == torch.device("cuda", 1), got.device
        assert torch.equal(got, want), f"{name}: other values with cuda:0 current"


def _launchers():
    """(module, name, launcher) of every launcher the generated modules build."""
    import importlib
    import pkgutil

    import generated
    from codegen.runtime.launcher import Signature

    found = []
    for info in pkgutil.iter_modules(generated.__path__):
        module = importlib.import_module(f"generated.{info.name}")
        found += [(module, name, f) for name, f in vars(module).items()
                  if isinstance(getattr(f, "signature", None), Signature)]
    return found


def test_every_kernel_has_a_launcher_built_from_its_signature():
    """Each generated module states its kernels' signatures and nothing of their host path: the
    runtime builds one launcher per kernel (forward and each memory mode's backward), under
    the kernel's name, in the module, whose source a traceback can show."""
    import inspect

    launchers = _launchers()
    names = {(m.__name__, name) for m, name, _ in launchers}
    kernels = {(m.__name__, name[:-4]) for m in {m for m, _, _ in launchers}
               for name in vars(m) if name.endswith("_per")}
    assert names == kernels and len(names) >= 40
    for module, name, f in launchers:
        assert f.__module__ == module.__name__ and f.__qualname__ == name
        assert f.signature.kind in ("fwd", "bwd")
        source = inspect.getsource(f)
        assert source.lstrip().startswith(f"def {name}(") and "plan.launch(" in source
        # the module's text holds the signature, not the host path
        text = inspect.getsource(module)
        assert "plan.launch(" not in text and "SCHEDULES.choose(" not in text


def test_launcher_source_follows_its_signature():
    """The launcher's source takes what the signature says, and only that: a windowed kernel's
    window, a backward's `into`, a split kernel's fallback, a foldable one's fold."""
    from codegen.runtime.launcher import source

    for _, name, f in _launchers():
        sig = f.signature
        text = source(sig)
        head = text.splitlines()[1]
        assert ("col_start=0, row_length=None" in head) == sig.windowed, name
        assert ("into=None" in head) == (sig.kind == "bwd" and bool(sig.into)), name
        assert ("SCHEDULES.refuse_split" in text) == (sig.split_span is not None), name
        assert ("launch_cooperative_grid" in text) == bool(sig.split_span), name
        assert ("fold_block_n" in text) == sig.foldable, name
        for store, flag in sig.element_stores + sig.row_stores:
            assert (f"{flag}=store_{store}" in text) == (flag is not None), (name, store)
        compile(text, name, "exec")


def _failing(name: str):
    """layernorm's launcher `name` built again over its kernels, its torch path raising."""
    from codegen.runtime import launcher

    def failing(*args, **kwargs):
        raise RuntimeError("from the torch path")

    return launcher.build(getattr(layernorm, name).signature, module=layernorm.__name__,
                          per=getattr(layernorm, f"{name}_per"),
                          red=getattr(layernorm, f"{name}_red"),
                          split=getattr(layernorm, f"{name}_split", None), torch_path=failing,
                          schedules=layernorm.SCHEDULES)


def test_a_failing_launch_shows_the_launchers_line(monkeypatch):
    """A launcher's frames carry its source: an error inside shows the failing line."""
    import traceback

    x = torch.zeros((0, 8))  # no rows: the torch path
    with pytest.raises(RuntimeError, match="from the torch path") as caught:
        _failing("_layernorm_fwd")(x, None, None, 1e-5, 0.0, False, False)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert any(frame.name == "_layernorm_fwd" and frame.line.startswith("return torch_path(")
               for frame in frames), frames


def test_every_backward_op_is_built_from_its_launchers_signature():
    """Each generated module states its backward launchers' signatures and nothing of their
    torch.library ops: the runtime registers one op a memory mode, taking the launcher's inputs
    and flags, whose source a traceback can show."""
    import ast
    import inspect
    import linecache

    modules = {m for m, _, _ in _launchers() if hasattr(m, "_BACKWARD_OPS")}
    assert len(modules) >= 15
    for module in modules:
        op = module.__name__.rpartition(".")[2]
        text = inspect.getsource(module)
        assert f'custom_op("vjpforge::{op}_backward_' not in text
        assert f"def _{op}_backward_" not in text
        modes = vars(module._BACKWARDS)
        assert list(vars(module._BACKWARD_OPS)) == list(modes)
        for mode, f in modes.items():
            # the op's source as registered (the registry's op may be another module's of the
            # same name: a test may import a variant of this one)
            text = "".join(linecache.getlines(f"<vjpforge op {module.__name__}."
                                              f"{op}_backward_{mode}>"))
            assert f'"vjpforge::{op}_backward_{mode}"' in text, (op, mode)
            defined = next(node for node in ast.walk(ast.parse(text))
                           if isinstance(node, ast.FunctionDef)
                           and node.name == f"_{op}_backward_{mode}_op")
            sig = f.signature
            assert [a.arg for a in defined.args.args] == [*sig.inputs, *sig.flags], (op, mode)


@functools.cache
def _failing_backward_ops():
    """layernorm's default backward, its torch path raising, through an op of its own."""
    from codegen.runtime import launcher

    rebuilt = _failing("_layernorm_bwd_default")
    return launcher.backward_ops("failing_layernorm", launcher.Backwards(default=rebuilt),
                                 module=layernorm.__name__)


def test_a_failing_backward_op_shows_its_line():
    """A backward op's frames carry its source: an error inside shows the failing line."""
    import traceback

    dy = torch.zeros((0, 8))  # no rows: the torch path
    rows = torch.zeros((0,))
    with pytest.raises(RuntimeError, match="from the torch path") as caught:
        _failing_backward_ops().default(dy, dy, None, None, rows, rows, 0.0, False, False)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert any(frame.name == "_failing_layernorm_backward_default_op"
               and frame.line.startswith("dx, dweight, dbias, = _launcher(")
               for frame in frames), frames


def test_every_forward_op_is_built_from_its_launchers_signature():
    """Each generated module states its forward launcher's signature and what each memory mode
    keeps, and nothing of its torch.library op: the runtime registers the op and its fake, taking
    the launcher's inputs, the mode and the output flags, whose source a traceback can show, and
    the Function's forward runs the same forward."""
    import ast
    import inspect
    import linecache

    modules = {m for m, _, _ in _launchers() if hasattr(m, "_FORWARD")}
    assert len(modules) >= 15
    for module in modules:
        op = module.__name__.rpartition(".")[2]
        assert f'custom_op("vjpforge::{op}"' not in inspect.getsource(module)
        assert module._MODES == tuple(module._KEEPS)
        text = "".join(linecache.getlines(f"<vjpforge op {module.__name__}.{op}>"))
        assert f'"vjpforge::{op}"' in text, op
        defined = {node.name: node for node in ast.walk(ast.parse(text))
                   if isinstance(node, ast.FunctionDef)}
        sig = getattr(module, f"_{op}_fwd").signature
        params = [a.arg for a in defined[f"_{op}_op"].args.args]
        assert params[:len(sig.inputs) + 1] == [*sig.inputs, "memory"], op
        assert [a.arg for a in defined[f"_{op}_fake"].args.args] == params, op
        assert "_FORWARD(" in inspect.getsource(module._Function.forward), op


def test_a_mode_stores_what_it_keeps_and_what_is_asked():
    """The forward of each memory mode stores the results the mode keeps for its backward, and
    an optional output only where the caller asks for it."""
    import generated.add_layernorm as add_layernorm

    x = torch.zeros((2, 8), dtype=torch.float64)
    for memory, kept in add_layernorm._KEEPS.items():
        for want in (False, True):
            y, residual_out, mean, rstd = add_layernorm._FORWARD(
                x, x, None, None, None, 1e-5, memory, want, None)
            stored = {name for name, t in zip(("residual_out", "mean", "rstd"),
                                              (residual_out, mean, rstd), strict=True)
                      if t is not None}
            assert stored == set(kept) | ({"residual_out"} if want else set()), (memory, want)


@functools.cache
def _failing_forward():
    """layernorm's forward, its torch path raising, through an op of its own."""
    from codegen.runtime import launcher

    return launcher.forward_op("failing_layernorm", _failing("_layernorm_fwd"), layernorm._KEEPS,
                               outputs=("y",), module=layernorm.__name__)


def test_a_failing_forward_op_shows_its_lines():
    """A forward op's frames carry its source: an error inside shows the failing lines."""
    import traceback

    x = torch.zeros((0, 8))  # no rows: the torch path
    with pytest.raises(RuntimeError, match="from the torch path") as caught:
        _failing_forward().op(x, None, None, 1e-5, 0.0, "default")
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert any(frame.name == "_failing_layernorm_op"
               and frame.line.startswith("outputs = _failing_layernorm_forward(")
               for frame in frames), frames
    assert any(frame.name == "_failing_layernorm_forward"
               and frame.line.startswith("return _launcher(")
               for frame in frames), frames
