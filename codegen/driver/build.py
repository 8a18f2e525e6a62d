"""Everything `derive` writes, as {relative path: text}: one module and one page per op and
per layer (block spec)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import sympy

from codegen.driver.pages import render_page
from codegen.emit import (
    ModuleSpec,
    positive_tensors,
    render_facade,
    render_module,
    render_patch,
    render_user_test,
)
from codegen.ir import Kernel
from codegen.layers import render_layer, render_layer_page
from codegen.lower import lower
from codegen.printers import PrintError
from derive.algebra import sorted_symbols
from derive.api import dropout_mismatches, variant_mismatches
from derive.backward import differentiable_nodes, gradient_name
from derive.blocks import check_ops, load_block
from derive.engine import Derivation, derive, load_spec
from derive.higher import RecordedBackward
from derive.reverse import upstream_symbol
from derive.spec import Kind, Level, OpSpec, SpecError

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "derive" / "ops"
LAYERS = ROOT / "derive" / "layers"


def op_files() -> list[Path]:
    return sorted(p for p in OPS.glob("*.py") if p.name != "__init__.py")


def layer_files() -> list[Path]:
    """Block specs; files starting with `_` hold pieces they share."""
    return sorted(p for p in LAYERS.glob("*.py") if not p.name.startswith("_"))


def build_layer(path: Path, functions: dict[str, str]) -> tuple[str, str, str]:
    """(name, module source, docs page) of one block spec; `functions` maps each op to its API
    function."""
    block = load_block(path, path.relative_to(ROOT).as_posix())
    if block.name in functions:
        raise SpecError(f"{block.source}: block '{block.name}' has the name of an op")
    check_ops(block, functions)
    return block.name, render_layer(block), render_layer_page(block)


def build_op(path: Path, display: str) -> tuple[Derivation, str, str]:
    """(derivation, module source, docs page) of one spec file."""
    return _generate(load_spec(path, display), display)


def _generate(spec: OpSpec, display: str,
              module_path: str | None = None) -> tuple[Derivation, str, str]:
    """`_build`, with kernel code that cannot be printed blamed on its spec line; `module_path`
    is where the module is written when that is not generated/ (`derive SPEC --out DIR`)."""
    try:
        return _build(spec, module_path)
    except PrintError as error:
        raise SpecError(f"{_culprit(spec, error, display)}: cannot generate kernel code for "
                        f"{error}") from error


def _culprit(spec: OpSpec, error: PrintError, display: str) -> str:
    """The spec line to blame: the value that failed to print, else the first definition
    using the function that has no printer rule (a backward only differentiates it)."""
    for node in spec.nodes:
        if node.name == error.name:
            return node.where
    if error.offending is not None:
        kind = type(error.offending)
        for node in spec.nodes:
            if node.expr is None:
                continue
            derivatives = [sympy.diff(node.expr, s) for s in sorted_symbols(node.expr.free_symbols)]
            if node.expr.atoms(kind) or any(d.atoms(kind) for d in derivatives):
                return node.where
    return display


def build_user_op(path: Path, out: Path) -> dict[Path, str]:
    """`derive path/to/my_op.py --out DIR`: the module, its page and a finite-difference test."""
    spec = load_spec(path, path.name)
    name = spec.name
    derivation, source, page = _generate(spec, path.name, str(out / f"{name}.py"))
    return {out / f"{name}.py": source, out / f"{name}.md": page,
            out / f"test_{name}.py": render_user_test(module_spec(derivation.spec, derivation),
                                                      path.name, positive_tensors(spec))}


def _build(spec: OpSpec, module_path: str | None = None) -> tuple[Derivation, str, str]:
    siblings = variant_siblings(spec)
    derivation = derive(spec)
    module = module_spec(spec, derivation)
    forward = lower(derivation.forward, f"_{spec.name}_fwd", derivation.saved_outputs)
    backwards = {mode: lower(result.graph, f"_{spec.name}_bwd_{mode}")
                 for mode, result in derivation.backwards.items()}
    jvp = lower(derivation.tangent.graph, f"_{spec.name}_jvp")
    source = render_module(module, forward, backwards, jvp=jvp,
                           recorded=recorded_kernels(derivation), siblings=siblings)
    page = render_page(derivation, forward, backwards, jvp, module_path)
    return derivation, source, page


def variant_siblings(spec: OpSpec) -> dict[str, object]:
    """The APIs of the ops of derive/ops/ that the values of the spec's Variant argument select,
    or that compute its calls with dropout on (op name -> API), checked against the spec's own
    API."""
    variant = getattr(spec.api, "variant", None)
    dropout_op = getattr(spec.api, "dropout_op", None)
    ops = [op for _, op in variant.others] if variant is not None else []
    ops += [dropout_op] if dropout_op is not None else []
    siblings: dict[str, object] = {}
    for op in ops:
        path = OPS / f"{op}.py"
        siblings[op] = (load_spec(path, path.relative_to(ROOT).as_posix()).api
                        if path.is_file() else None)
    problems = variant_mismatches(spec.api, siblings)
    if problems:
        raise SpecError(f"{spec.api_where}: op.api ({type(spec.api).__name__}) does not match "
                        "the ops its variant selects: " + "; ".join(problems))
    problems = dropout_mismatches(spec.api, siblings)
    if problems:
        raise SpecError(f"{spec.api_where}: op.api ({type(spec.api).__name__}) does not match "
                        f"its dropout_op: " + "; ".join(problems))
    return siblings


def recorded_kernels(derivation: Derivation) -> dict[str, tuple[RecordedBackward, Kernel | None]
                                                     | None]:
    """Per memory mode, the backward autograd can record and the kernel derived for it (None
    where the mode's own serves); modes whose recorded backwards read the same values share
    the first one's kernel."""
    kernels: dict[tuple[tuple[str, ...], tuple[str, ...]], Kernel] = {}
    recorded = {}
    for mode, plan in derivation.recorded.items():
        if plan is None or plan.result is None:
            recorded[mode] = None if plan is None else (plan, None)
            continue
        key = (plan.reads, plan.hidden)
        if key not in kernels:
            kernels[key] = lower(plan.result.graph, f"_{derivation.spec.name}_bwd_{mode}_recorded")
        recorded[mode] = (plan, kernels[key])
    return recorded


def module_spec(spec: OpSpec, derivation: Derivation) -> ModuleSpec:
    return ModuleSpec(
        op=spec.name,
        doc=spec.doc,
        source=spec.source,
        api=spec.api,
        inputs=tuple(n.name for n in spec.nodes if n.kind is Kind.INPUT),
        params=tuple(n.name for n in spec.nodes
                     if n.kind in (Kind.COLUMN_PARAM, Kind.SCALAR_PARAM)),
        scalars=tuple(n.name for n in spec.nodes if n.kind is Kind.SCALAR),
        outputs=tuple(spec.outputs),
        modes=tuple((mode, tuple(saved), spec.mode_docs[mode])
                    for mode, saved in spec.modes.items()),
        upstream=tuple(s.name for s in derivation.reverse.upstream.values()),
        gradients=tuple((n.name, gradient_name(n.name)) for n in differentiable_nodes(spec)),
        row_inputs=tuple(n.name for n in spec.nodes if n.kind is Kind.ROW_INPUT),
        row_upstream=tuple(upstream_symbol(name).name for name in spec.differentiated
                           if spec.node(name).level is Level.ROW),
        undifferentiated=tuple(spec.undifferentiated),
        seeded=any(n.kind is Kind.RANDOM for n in spec.nodes),
        row_shape=any(n.broadcast or (n.kind is Kind.INDEX and n.level is Level.ROW)
                      for n in spec.nodes),
        broadcast_inputs=tuple(n.name for n in spec.nodes if n.broadcast),
        pairing=spec.pairing,
        tangent_inputs=derivation.tangent.inputs,
        tangent_outputs=derivation.tangent.outputs,
    )


def build_all(progress: Callable[[str], None] = lambda line: None) -> dict[str, str]:
    files: dict[str, str] = {}
    apis, memory = [], {}
    for path in op_files():
        start = time.perf_counter()
        display = path.relative_to(ROOT).as_posix()
        derivation, source, page = build_op(path, display)
        name = derivation.spec.name
        files[f"generated/{name}.py"] = source
        files[f"docs/ops/{name}.md"] = page
        apis.append((name, derivation.spec.api))
        memory[name] = tuple(derivation.spec.modes)
        progress(f"derive: {name:<12} {time.perf_counter() - start:6.2f} s")
    functions = {name: api.function for name, api in apis}
    for path in layer_files():
        start = time.perf_counter()
        name, source, page = build_layer(path, functions)
        files[f"generated/{name}.py"] = source
        files[f"docs/layers/{name}.md"] = page
        progress(f"derive: {name:<12} {time.perf_counter() - start:6.2f} s")
    files["generated/patch.py"] = render_patch(apis, memory)
    files["vjpforge.py"] = render_facade(
        {path[len("generated/"):-len(".py")]: text for path, text in files.items()
         if path.startswith("generated/") and path.endswith(".py")})
    files["generated/__init__.py"] = (
        '"""Generated by `derive`: one module per op spec in derive/ops/ and per block spec in '
        'derive/layers/. Do NOT modify."""\n')
    return files
