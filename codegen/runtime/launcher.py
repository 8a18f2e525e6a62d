"""The launcher of a generated kernel, built here from the declarative signature its module states.

A generated module states, per kernel, only what the kernel takes and writes (`Signature`: its
tensors by role, its scalars, its stores and their flags, what it can do: fold, window, split).
`build` writes the launcher's Python source once, at the module's import, from that signature,
compiles it, and returns the function: the host path every kernel shares (argument roles to
kernel arguments, the launch key, plan look-up, schedule choice, allocation, alignment, the
split fallback, column sums) lives once, here, and each launcher runs straight-line code with
nothing left to decide from the signature per call. Its source is registered with `linecache`
so that tracebacks and debuggers show it.

The forward of each memory mode (`forward_op`: the forward launcher storing what the mode keeps
for its backward and what the caller asks for) and each mode's backward (`backward_ops`) are
torch.library ops too: their ops and fakes are written and registered the same way, from the
launchers' signatures and what each mode keeps, so that the module states none of them.

A launcher takes its kernel's (M, N) row tensors and returns its outputs. It runs the torch path
(the module's `<name>_torch`) where there is nothing to launch: no rows or columns, a CPU tensor
outside Triton's interpreter, meta and fake tensors (`launch.use_triton`).
"""

from __future__ import annotations

import dataclasses
import linecache
import types
from typing import Optional

import torch
import triton

from codegen.runtime import checks, launch
from codegen.runtime.schedules import fixed_n, maxnreg


@dataclasses.dataclass(frozen=True)
class Signature:
    """What one kernel takes and writes, in its argument order."""

    #: the launcher's name (`<op>_fwd`, `<op>_bwd_<mode>`); its kernels are `<name>_per`,
    #: `<name>_red` and, where it splits, `<name>_split`
    name: str
    #: the schedule table's kind ("fwd" or "bwd")
    kind: str
    #: the kernel's inputs, the launcher's first parameters; after them come its `flags`, its
    #: `dtypes`, then its window and `into`
    inputs: tuple[str, ...]
    #: (M, N) element inputs: (name, the constexpr saying it is given, or None where it always is)
    elements: tuple[tuple[str, str | None], ...]
    #: tensors taken by address after the element inputs (columns, per-tensor scalars, rows, the
    #: seed): (name, the constexpr saying it is given, or None where it always is)
    pointers: tuple[tuple[str, str | None], ...] = ()
    #: element inputs read as (D0, D1, D2, N) views with broadcast dims of stride 0
    broadcast: tuple[str, ...] = ()
    #: Python floats, each passed as its fp32 rounding and the rest (`launch.fp32_pair`)
    scalars: tuple[str, ...] = ()
    #: scalars that may be off: (name, the value that means off, the constexpr saying it is on)
    switches: tuple[tuple[str, str, str], ...] = ()
    #: (M, N) outputs: (name, the constexpr saying it is stored, or None where it always is)
    element_stores: tuple[tuple[str, str | None], ...] = ()
    #: (M,) outputs in the accumulator's dtype: (name, constexpr or None)
    row_stores: tuple[tuple[str, str | None], ...] = ()
    #: sums over the rows (a weight's gradient): (name, the tensor whose shape and dtype the sum
    #: takes, the constexpr saying it is stored), summed from per-program partial rows
    column_stores: tuple[tuple[str, str, str], ...] = ()
    #: sums over every element: (name, like, constexpr), as column_stores
    scalar_stores: tuple[tuple[str, str, str], ...] = ()
    #: element tensors the kernel always reads (optional ones add where given): the schedule's
    #: loads
    required_loads: int = 1
    #: elementwise only: contiguous rows may be read as rows of the fold width
    foldable: bool = False
    #: takes `col_start` and `row_length`: its tensors are a window of wider rows
    windowed: bool = False
    #: takes `row_shape` (D0, D1, D2): a broadcast input's or a row index's dims
    row_shape: bool = False
    #: whether the looped kernel has the ONE_SWEEP constexpr
    one_sweep: bool = False
    #: None: the kernel never splits rows; else the partial row sums a split program publishes
    #: per exchange (0: a split kernel that never exchanges)
    split_span: int | None = None
    #: indices of element_stores whose memory the caller may give (`into`)
    into: tuple[int, ...] = ()
    #: the names returned, in order
    returns: tuple[str, ...] = ()

    @property
    def first(self) -> str:
        """The element input whose shape, dtype and device the call takes."""
        return next(name for name, flag in self.elements if flag is None)

    @property
    def flags(self) -> list[str]:
        """A parameter for each output stored on request, `store_<name>`: the element and row
        stores that have a flag, then every column and scalar sum."""
        stored = [name for name, flag in (*self.element_stores, *self.row_stores) if flag]
        stored += [name for name, _, _ in (*self.column_stores, *self.scalar_stores)]
        return [f"store_{name}" for name in stored]

    @property
    def dtypes(self) -> list[str]:
        """A parameter for each (M, N) output stored on request, `<name>_dtype`: the dtype it
        is stored in (a residual stream kept in fp32), None (the default) for the input's."""
        return [f"{name}_dtype" for name, flag in self.element_stores if flag]

    @property
    def made(self) -> tuple[str, ...]:
        """The results the kernel stores, once each in return order: a return that is an input
        or another result (an alias) is that one's, not made again."""
        stores = {name for name, *_ in (*self.element_stores, *self.row_stores,
                                        *self.column_stores, *self.scalar_stores)}
        return tuple(dict.fromkeys(name for name in self.returns if name in stores))

    @property
    def call_params(self) -> list[str]:
        """The launcher's parameters before its window and `into`, by name."""
        return [*self.inputs, *self.flags, *self.dtypes]


class _Writer:
    """Python source lines at an indentation."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, *lines: str) -> None:
        self.lines.extend("    " * self.depth + line if line else "" for line in lines)

    def block(self, head: str) -> _Block:
        self(head)
        return _Block(self)


class _Block:
    def __init__(self, writer: _Writer):
        self.writer = writer

    def __enter__(self):
        self.writer.depth += 1

    def __exit__(self, *exc):
        self.writer.depth -= 1


def _address(name: str, optional: bool, direct: bool, first: str) -> str:
    """A tensor argument: its address (`direct`: a plan's launch) or the tensor (the JIT's),
    the first element input standing in for an absent one."""
    if direct:
        return f"{name}_ptr"
    return f"{name} if {name} is not None else {first}" if optional else name


def _arguments(sig: Signature, direct: bool) -> list[str]:
    """The kernel's positional arguments, one line each."""
    first, lines = sig.first, []
    for name, flag in sig.elements:
        if name in sig.broadcast:
            # a (D0, D1, D2, N) view, broadcast dims of stride 0: read in place, never expanded
            lines.append(f"{_address(name, True, direct, first)}, *{name}_strides,")
        else:
            lines.append(f"{_address(name, flag is not None, direct, first)}, {name}_stride,")
    lines += [f"{_address(name, flag is not None, direct, first)}," for name, flag in sig.pointers]
    for name, flag in sig.element_stores:
        rows = f"N if store_{name} else 0" if flag else "N"
        lines.append(f"{_address(name, flag is not None, direct, first)}, {rows},")
    lines += [f"{_address(name, flag is not None, direct, first)},"
              for name, flag in sig.row_stores]
    lines += [f"{_address(name + '_partial', True, direct, first)},"
              for name, _, _ in sig.column_stores + sig.scalar_stores]
    lines += [f"*launch.fp32_pair({name})," for name in sig.scalars]
    lines.append("M, N,")
    if sig.windowed:
        lines.append("col_start, row_length,")
    if sig.row_shape:
        lines.append("row_shape[1], row_shape[2],")
    if sig.split_span is not None:
        lines.append(f"{_address('split_sums', True, direct, first)}, "
                     f"{_address('split_count', True, direct, first)},")
    return lines


def _sweep_constexprs(sig: Signature) -> list[str]:
    """The persistent and looped kernels' constexprs besides ACC, ROWS and BLOCK_N."""
    lines = ["STAGES=schedule.stages,", "CHUNKS=schedule.chunks,"]
    if sig.one_sweep:
        lines.append("ONE_SWEEP=schedule.one_sweep,")
    lines += ["KEEP=schedule.keep,", "EVEN=schedule.even,", "STRIDED=schedule.strided,",
              "REVERSE=schedule.reverse,", "LAST_FIRST=schedule.last_first,"]
    if sig.broadcast:
        lines.append("FIXED_N=0,")
    else:
        # an absent optional tensor allows FIXED_N; a present one of row stride 0 (a row
        # broadcast over the rows) does not: the kernel must read it through its stride
        strides = [f"N if {name} is None else {name}_stride" if flag else f"{name}_stride"
                   for name, flag in sig.elements]
        lines.append(f"FIXED_N=fixed_n(schedule, M, N, {', '.join(strides)}),")
    return lines


def _launch(w: _Writer, sig: Signature, stores, reduced) -> None:
    """Launch through the call's plan, or through Triton's JIT, keeping a plan for the next."""
    with w.block("if plan:"):
        w("plan.launch(")
        with _Block(w):
            w("plan.grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(key[1]), *plan.head,",
              *_arguments(sig, True), "*plan.tail,")
        w(")")
    with w.block("else:"):
        w("kernel = red if schedule.looped else per", "arguments = (")
        with _Block(w):
            w(*_arguments(sig, False))
        w(")", "constexprs = dict(")
        with _Block(w):
            w(*(f"{flag}={e} is not None," for e, flag in sig.elements if flag))
            w(*(f"{flag}={p} is not None," for p, flag in sig.pointers if flag))
            w(*(f"{flag}={s} != {absent}," for s, absent, flag in sig.switches))
            w(*(f"{flag}=store_{s}," for s, flag in stores if flag))
            w(*(f"{flag}=store_{s}," for s, _, flag in reduced))
            w("ACC=launch.TRITON_ACC[acc],", "ROWS=schedule.rows,", "BLOCK_N=schedule.block_n,")
        w(")", "options = {}")
        if sig.split_span is not None:
            with w.block("if schedule.split:"):
                w("kernel = split",
                  "constexprs.update(SPLIT=schedule.split, "
                  "MEMBERS=triton.next_power_of_2(schedule.split), FIXED_N=0)")
                if sig.split_span:
                    # every program of a group at once, or the launch fails (never a deadlock)
                    with w.block('if device.type == "cuda":'):
                        w('options["launch_cooperative_grid"] = True')
            with w.block("else:"):
                _sweep_update(w, sig)
        else:
            _sweep_update(w, sig)
        w("grid = (schedule.programs,)",
          "registers = maxnreg(schedule.warps, schedule.programs, device) "
          "if schedule.regs else None")
        with w.block("with launch.ieee(device):"):
            w("compiled = kernel[grid](*arguments, **constexprs, num_warps=schedule.warps, "
              "maxnreg=registers, **options)")
        w("SCHEDULES.keep(key, launch.make_plan(schedule, kernel, compiled, grid, "
          "len(arguments), constexprs))")


def _sweep_update(w: _Writer, sig: Signature) -> None:
    w("constexprs.update(")
    with _Block(w):
        w(*_sweep_constexprs(sig))
    w(")")


def source(sig: Signature) -> str:
    """The source of `_make(per, red, split, torch_path, SCHEDULES)`, which returns the
    launcher of `sig` over those kernels, torch path and schedules."""
    w = _Writer()
    name = sig.name
    params = [*sig.inputs, *sig.flags, *(f"{name}=None" for name in sig.dtypes)]
    params += ["col_start=0", "row_length=None"] if sig.windowed else []
    params += ["into=None"] if sig.kind == "bwd" and sig.into else []
    w("def _make(per, red, split, torch_path, SCHEDULES):")
    with _Block(w):
        w(f"def {name}({', '.join(params)}):")
        with _Block(w):
            _body(w, sig)
        w(f"return {name}")
    return "\n".join(w.lines) + "\n"


def _body(w: _Writer, sig: Signature) -> None:
    """The launcher's statements."""
    first, name = sig.first, sig.name
    into = sig.kind == "bwd" and bool(sig.into)
    calls = ", ".join(sig.call_params)
    again = calls + (", into=into" if into else "")
    again += ", col_start=col_start, row_length=row_length" if sig.windowed else ""
    torch_args = calls + (", col_start, row_length" if sig.windowed else "")
    elements = [e for e, _ in sig.elements]
    optional = {e for e, flag in sig.elements if flag}
    pointers = [*sig.elements, *sig.pointers]
    stores = sig.element_stores + sig.row_stores
    reduced = sig.column_stores + sig.scalar_stores
    split = sig.split_span is not None
    w(f"M, N = {first}.shape")
    if sig.windowed:
        # columns col_start .. col_start + N of rows of row_length columns
        w("row_length = N if row_length is None else row_length")
    with w.block(f"if M == 0 or N == 0 or not launch.use_triton({first}):"):
        w(f"return torch_path({torch_args})")
    w(f"acc = launch.accumulator({first}.dtype)", f"device = {first}.device")
    # Triton compiles for and launches on the current device: make it the tensors' device, as
    # torch's own ops do
    with w.block(f"if {first}.is_cuda and device.index != torch._C._cuda_getDevice():"):
        with w.block("with torch.cuda.device(device):"):
            w(f"return {name}({again})")
    if sig.foldable:
        # elementwise only, on contiguous rows: read as rows of `fold` columns, which tile the
        # blocks that padded rows of N would not
        w("fold = SCHEDULES.constants.fold_block_n")
        contiguous = "".join(f" and {e}.stride(0) == N" for e in elements)
        with w.block(f"if fold and N % fold and not M * N % fold{contiguous}:"):
            w("folded = (M * N // fold, fold)")
            if into:
                w("into = tuple(t.view(folded) if t is not None else None for t in into) "
                  "if into is not None else None")
            viewed = ", ".join(f"{p}.view(folded)" if p in elements else p
                               for p in sig.call_params)
            w(f"outputs = {name}({viewed}{', into=into' if into else ''})",
              "return tuple(t.view(M, N) if t is not None else None for t in outputs)")
    for e in elements:
        if e in sig.broadcast:
            w(f"{e}_strides = {e}.stride()[:3] if {e} is not None else (0, 0, 0)")
        elif e in optional:
            w(f"{e}_stride = {e}.stride(0) if {e} is not None else 0")
        else:
            w(f"{e}_stride = {e}.stride(0)")
    w("plan = key = None")
    with w.block(f"if {first}.is_cuda and launch.direct():"):
        for p, flag in pointers:
            if p == first or not flag:
                w(f"{p}_ptr = {p}.data_ptr()")
            else:
                w(f"{p}_ptr = {p}.data_ptr() if {p} is not None else {first}_ptr")
        # what the schedule, the buffers and Triton's compile depend on
        # (`launch.specializations`)
        key = [repr(name), "device.index", "M", "N"]
        key += ["col_start", "row_length"] if sig.windowed else []
        for p, flag in pointers:
            key += [f"{p} is not None and {p}.dtype" if flag else f"{p}.dtype", f"{p}_ptr & 15"]
        key += [f"{e}_strides" if e in sig.broadcast else f"{e}_stride" for e in elements]
        key += ["row_shape[1]", "row_shape[2]"] if sig.row_shape else []
        key += [f"store_{s}" for s, flag in stores if flag]
        key += [f"store_{s}" for s, _, _ in reduced]
        key += [f"{s}_dtype" for s, flag in sig.element_stores if flag]
        key += [f"{s} != {absent}" for s, absent, _ in sig.switches]
        w(f"key = ({', '.join(key)},)")
        w("plan = SCHEDULES.plans.get(key)")
    loads = str(sig.required_loads) + "".join(f" + ({e} is not None)" for e in elements
                                              if e in optional)
    w(f"schedule = plan.schedule if plan else SCHEDULES.choose(M, N, {bool(reduced)}, "
      f"{sig.kind!r}, {loads}, {first}.element_size(), device{', True' if split else ''})")
    dense = first not in sig.broadcast
    like = (f"torch.empty_like({first}) if {first}_stride == N else "
            f"torch.empty((M, N), dtype={first}.dtype, device=device)" if dense
            else f"torch.empty((M, N), dtype={first}.dtype, device=device)")
    for i, (s, flag) in enumerate(sig.element_stores):
        if into and i in sig.into:
            given = f"into[{i}]"
            w(f"{s} = {given} if into is not None and {given} is not None else {like}")
        elif flag:
            w(f"{s} = torch.empty((M, N), dtype={s}_dtype or {first}.dtype, device=device) "
              f"if store_{s} else None")
        else:
            # rows of stride N: empty_like allocates the same contiguous (M, N) for half the
            # host time
            w(f"{s} = {like}")
    for s, flag in sig.row_stores:
        w(f"{s} = torch.empty((M,), dtype=acc, device=device)"
          + (f" if store_{s} else None" if flag else ""))
    for s, _, _ in sig.column_stores:
        w(f"{s}_partial = launch.partials(store_{s}, schedule, N, acc, device)")
    for s, _, _ in sig.scalar_stores:
        w(f"{s}_partial = launch.partials(store_{s}, schedule, 1, acc, device)")
    if split:
        w("split_sums = split_count = None")
        if sig.split_span:
            # a group's exchange slots (two, each a partial per row, reduction and member) and
            # its counter of arrivals, which starts at zero
            with w.block("if schedule.split:"):
                w("split_sums = torch.empty((schedule.programs // schedule.split * 2 * "
                  f"triton.next_power_of_2(schedule.split) * {sig.split_span} * schedule.rows,), "
                  "dtype=acc, device=device)",
                  "split_count = torch.zeros((schedule.programs // schedule.split,), "
                  "dtype=torch.int32, device=device)")
    with w.block("if plan:"):
        if split:
            w(f"split_sums_ptr = split_sums.data_ptr() if split_sums is not None else {first}_ptr",
              f"split_count_ptr = split_count.data_ptr() if split_count is not None else "
              f"{first}_ptr")
        for s, flag in stores:
            w(f"{s}_ptr = {s}.data_ptr()" + (f" if store_{s} else 0" if flag else ""))
        for s, _, _ in reduced:
            w(f"{s}_partial_ptr = {s}_partial.data_ptr() if store_{s} else 0")
        # the caching allocator aligns its buffers; the plan's kernel was compiled for aligned
        # ones
        addresses = ([f"{s}_ptr" for s, _ in stores] + [f"{s}_partial_ptr" for s, _, _ in reduced]
                     + ["split_sums_ptr", "split_count_ptr"] * split)
        if addresses:
            with w.block(f"if ({' | '.join(addresses)}) & 15:"):
                w("plan = key = None")
    if split:
        with w.block("try:"):
            _launch(w, sig, stores, reduced)
        with w.block("except RuntimeError as error:"):
            with w.block("if not (schedule.split and launch.refused(error)):"):
                w("raise")
            # the device would not hold every program of the groups at once: this call and
            # every later one on it run unsplit
            w("SCHEDULES.refuse_split(device.index)", f"return {name}({again})")
    else:
        _launch(w, sig, stores, reduced)
    if sig.column_stores:
        w(f"{', '.join(s for s, _, _ in sig.column_stores)}, = launch.column_sums(")
        with _Block(w):
            w(*(f"({s}_partial, {like_})," for s, like_, _ in sig.column_stores))
        w(")")
    for s, like_, _ in sig.scalar_stores:
        w(f"{s} = {s}_partial.sum().to({like_}.dtype).reshape({like_}.shape) "
          f"if store_{s} else None")
    w(f"return {', '.join(sig.returns)},")


#: what a launcher's source reads besides its `_make` arguments
_NAMESPACE = {"torch": torch, "triton": triton, "launch": launch, "fixed_n": fixed_n,
              "maxnreg": maxnreg}


def build(sig: Signature, *, module: str, per, red, split=None, torch_path, schedules):
    """The launcher of `sig` over its module's kernels (`per`: whole rows per program, `red`:
    looped rows, `split`: rows split over programs), torch path and schedules."""
    namespace = _compiled(source(sig), f"<vjpforge launcher {module}.{sig.name}>",
                          dict(_NAMESPACE))
    function = namespace["_make"](per, red, split, torch_path, schedules)
    function.__module__, function.__qualname__ = module, sig.name
    function.signature = sig
    return function


class Backwards(types.SimpleNamespace):
    """Each memory mode's backward, by the mode's name: its launcher (what a generated
    Function's backward runs), or the launcher's call through its torch.library op (`through`:
    what it runs for the op's autograd)."""


def through(op, launcher):
    """`launcher`'s call made through `op`, its torch.library op, which returns the results
    the launcher makes (`Signature.made`): the launcher's arguments and results, a result not
    stored None (the op returns an empty tensor for it) and a result that is another one or an
    input that one. `into` is not passed on: an op's results are its own memory
    (`mutates_args=()`)."""
    sig = launcher.signature
    params, made = sig.call_params, sig.made
    # the results stored on request, by their flag's parameter
    flags = {name: f"store_{name}" for name, flag in (*sig.element_stores, *sig.row_stores)
             if flag}
    flags.update((name, f"store_{name}") for name, _, _ in (*sig.column_stores,
                                                            *sig.scalar_stores))

    def call(*args, into=None, **named):
        # the arguments by name: the leading ones given positionally, the flags by keyword
        values = dict(zip(params, args, strict=False), **named)
        values.update(zip(made, op(*(values[name] for name in params)), strict=True))
        return tuple(values[name] if values.get(flags.get(name), True) else None
                     for name in sig.returns)

    call.__name__ = call.__qualname__ = f"{sig.name}_through_op"
    return call


def _annotation(sig: Signature, name: str) -> str:
    """The schema type of input `name`, as torch.library infers it from the annotation."""
    optional = {e for e, flag in (*sig.elements, *sig.pointers) if flag}
    if name in optional:
        return "Optional[torch.Tensor]"
    if name in sig.scalars:
        return "float"
    return "list[int]" if name == "row_shape" else "torch.Tensor"


def _op_head(w: _Writer, op: str, params: list[str]) -> None:
    """The head of the torch.library op `vjpforge::<op>`, `_<op>_op`: its parameters
    annotated ("name: type", the op's schema), its outputs a list of tensors."""
    w(f'@torch.library.custom_op("vjpforge::{op}", mutates_args=())', f"def _{op}_op(")
    with _Block(w):
        w(*(f"{param}," for param in params))
    w(") -> list[torch.Tensor]:")


def op_source(sig: Signature, op: str) -> str:
    """The source of `_make(launcher)`, which registers the torch.library op `vjpforge::<op>`
    of backward launcher `sig`, and its fake, and returns the op. The op takes the launcher's
    inputs and flags and returns the results it makes (`Signature.made`), a result not stored
    an empty tensor (an op's outputs never are None)."""
    if sig.dtypes or sig.row_stores:
        # an op's schema has no dtype arguments, and a fake below no (M,) rows
        raise ValueError(f"{sig.name}: a backward op stores no dtypes or rows")
    first, w = sig.first, _Writer()
    flagged = dict((*sig.element_stores, *((s, flag) for s, _, flag in sig.column_stores
                                           + sig.scalar_stores)))
    like = {s: like_ for s, like_, _ in sig.column_stores + sig.scalar_stores}
    params = [*sig.inputs, *sig.flags]
    made = sig.made
    w("def _make(_launcher):")
    with _Block(w):
        _op_head(w, op, [*(f"{name}: {_annotation(sig, name)}" for name in sig.inputs),
                         *(f"{flag}: bool" for flag in sig.flags)])
        with _Block(w):
            # a result that is another one or an input is not the op's: unpacked to `_`
            targets = [name if name in made and name not in sig.returns[:i] else "_"
                       for i, name in enumerate(sig.returns)]
            w(f"{', '.join(targets)}, = _launcher({', '.join(params)})", "return [")
            with _Block(w):
                w(*(f"{name} if {name} is not None else {first}.new_empty(0)," for name in made))
            w("]")
        w("", f"@_{op}_op.register_fake", f"def _{op}_fake({', '.join(params)}):")
        with _Block(w):
            # an output not stored is a tensor of its own, as the op's (outputs never alias)
            w("return [")
            with _Block(w):
                for name in made:
                    shape = (f"{like[name]}.new_empty({like[name]}.shape)" if name in like
                             else f"{first}.new_empty({first}.shape)")
                    w(f"{shape} if store_{name} else {first}.new_empty(0),"
                      if flagged[name] else f"{shape},")
            w("]")
        w("", f"return _{op}_op")
    return "\n".join(w.lines) + "\n"


def _compiled(text: str, filename: str, namespace: dict, **flags) -> dict:
    """`namespace` after running `text`, registered with linecache as `filename`."""
    # tracebacks and debuggers read the source of a frame through linecache
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(compile(text, filename, "exec", **flags), namespace)  # noqa: S102 - our own source
    return namespace


def backward_ops(op: str, backwards: Backwards, *, module: str) -> Backwards:
    """Registers each memory mode's backward launcher in `backwards` as the torch.library op
    `vjpforge::<op>_backward_<mode>`, with its fake (`op_source`), and returns each mode's
    call through its op (`through`), as the op's autograd runs it."""
    calls = {}
    for mode, function in vars(backwards).items():
        name = f"{op}_backward_{mode}"
        text = op_source(function.signature, name)
        # the ops' annotations are their schema: objects, not this module's postponed strings
        namespace = _compiled(text, f"<vjpforge op {module}.{name}>",
                              {"__name__": module, "torch": torch, "Optional": Optional},
                              dont_inherit=True)
        calls[mode] = through(namespace["_make"](function), function)
    return Backwards(**calls)


def _store_flag(name: str, keeps: dict[str, tuple[str, ...]], asked: bool) -> str:
    """Whether a call stores forward result `name` (one stored on request), as an expression of
    `memory` and of the caller's `want_<name>` (`asked`: an output the caller may ask for):
    stored where the call's mode keeps it for its backward, or where asked for."""
    always = [mode for mode, kept in keeps.items() if name in kept]
    others = [mode for mode in keeps if mode not in always]
    if not others:
        return "True"
    wanted = f"want_{name}" if asked else None
    if not always:
        return wanted or "False"
    if len(always) == 1:
        mode = f'memory == "{always[0]}"'
    elif len(others) == 1:
        mode = f'memory != "{others[0]}"'
    else:
        mode = "memory in (" + "".join(f'"{m}", ' for m in always) + ")"
    return f"{wanted} or {mode}" if wanted else mode


def forward_source(sig: Signature, op: str, keeps: dict[str, tuple[str, ...]],
                   outputs: tuple[str, ...]) -> str:
    """The source of `_make(launcher, modes)`, which returns the forward of forward launcher
    `sig` in each memory mode, and registers it as the torch.library op `vjpforge::<op>` with
    its fake, returning the op too.

    `keeps`: per memory mode, the default first, the results stored on request that the mode
    keeps for its backward. `outputs`: the op's outputs, the first always stored, each other
    one stored where the caller asks for it (`want_<name>`), an (M, N) one in float32 where
    asked (the forward's `<name>_dtype`, the op's `<name>_fp32`).

    The forward takes the launcher's inputs, `memory` and, per optional output, `want_<name>`
    (and `<name>_dtype`), and returns the launcher's results. The op takes the same with
    `<name>_fp32` for the dtype, and returns every result, one not stored an empty tensor."""
    flagged = {name for name, flag in (*sig.element_stores, *sig.row_stores) if flag}
    stores = [*sig.element_stores, *sig.row_stores]
    if sig.column_stores or sig.scalar_stores or sig.returns != tuple(n for n, _ in stores):
        # a fake below makes (M, N) and (M,) results, in the launcher's return order
        raise ValueError(f"{sig.name}: a forward returns its element then its row stores")
    optional = outputs[1:]
    kept = {name for names in keeps.values() for name in names}
    if not {*optional, *kept} <= flagged:
        raise ValueError(f"{sig.name}: {sorted({*optional, *kept} - flagged)} are not stored "
                         "on request")
    dtyped = [name for name in optional if name in dict(sig.element_stores)]
    first, w = sig.first, _Writer()
    wants = [p for name in optional
             for p in (f"want_{name}", *[f"{name}_dtype"] * (name in dtyped))]
    fp32 = [p for name in optional
            for p in (f"want_{name}", *[f"{name}_fp32"] * (name in dtyped))]
    flag = {name: _store_flag(name, keeps, name in optional) for name in flagged}
    check = f'checks.check_choice("vjpforge::{op}", "memory", memory, _modes)'
    w("def _make(_launcher, _modes):")
    with _Block(w):
        w(f"def _{op}_forward({', '.join([*sig.inputs, 'memory', *wants])}):")
        with _Block(w):
            call = [*sig.inputs, *(f"store_{name}={flag[name]}" for name, _ in stores
                                   if name in flagged), *(f"{n}_dtype={n}_dtype" for n in dtyped)]
            w(f"return _launcher({', '.join(call)})")
        w("")
        _op_head(w, op, [*(f"{name}: {_annotation(sig, name)}" for name in sig.inputs),
                         "memory: str", *(f"{name}: bool" for name in fp32)])
        with _Block(w):
            # an op's schema has no dtype arguments: its flag says float32, else the input's
            given = [p for name in optional for p in (
                f"want_{name}", *[f"torch.float32 if {name}_fp32 else None"] * (name in dtyped))]
            w(check, f"outputs = _{op}_forward({', '.join([*sig.inputs, 'memory', *given])})",
              f"return [t if t is not None else {first}.new_empty(0) for t in outputs]")
        w("", f"@_{op}_op.register_fake",
          f"def _{op}_fake({', '.join([*sig.inputs, 'memory', *fp32])}):")
        with _Block(w):
            w(check, f"M, N = {first}.shape")
            if sig.row_stores:
                w(f"acc = launch.accumulator({first}.dtype)")
            # an output not stored is a tensor of its own, as the op's (outputs never alias)
            w("return [")
            with _Block(w):
                for name, _ in stores:
                    if name in dict(sig.row_stores):
                        made = f"{first}.new_empty((M,), dtype=acc)"
                    elif name in dtyped:
                        made = (f"{first}.new_empty((M, N), dtype=torch.float32 if {name}_fp32 "
                                f"else {first}.dtype)")
                    else:
                        made = f"{first}.new_empty((M, N))"
                    stored = flag.get(name, "True")
                    w(f"{made}," if stored == "True" else f"{first}.new_empty(0),"
                      if stored == "False" else f"{made} if {stored} else {first}.new_empty(0),")
            w("]")
        w("", f"return _{op}_forward, _{op}_op")
    return "\n".join(w.lines) + "\n"


def forward_op(op: str, launcher, keeps: dict[str, tuple[str, ...]], *,
               outputs: tuple[str, ...], module: str):
    """The forward of `launcher` (the module's forward launcher) in each memory mode, keyed by
    `keeps` (`forward_source`), as the autograd Function's forward runs it; registers the same
    as the torch.library op `vjpforge::<op>`, with its fake, which is the result's `op`."""
    name = f"<vjpforge op {module}.{op}>"
    # the op's annotations are its schema: objects, not this module's postponed strings
    namespace = _compiled(forward_source(launcher.signature, op, keeps, outputs), name,
                          {"__name__": module, "torch": torch, "Optional": Optional,
                           "checks": checks, "launch": launch}, dont_inherit=True)
    function, op_ = namespace["_make"](launcher, tuple(keeps))
    function.op, function.__module__, function.__qualname__ = op_, module, function.__name__
    return function
