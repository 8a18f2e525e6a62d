"""A spec as torch's autograd sees it, and in exact arithmetic, against the engine's
derivation of it.

`spelled` evaluates a spec's nodes with torch's own ops, the spelling a user would write in
torch (Max is torch.maximum, or for more arguments torch.amax of their stack; Min likewise; Abs
torch.abs; sign torch.sign; Piecewise torch.where; Heaviside a torch.where of its values, with
a zero derivative), and takes the gradients with autograd. `derived` evaluates the engine's
forward graph and each memory mode's backward graph with the torch printer's own source, the
plain-torch path the generated modules run. Both work on (M, N) rows in any float dtype, so
their values can be compared at any input: at ties of Max/Min/Abs and Piecewise boundaries,
and at magnitudes where an exponential overflows. `exact` evaluates the spec as written in
arbitrary precision (mpmath), its gradients by forward mode: the value a spelling has
where torch's fp64 overflows or cancels (away from ties, where it is differentiable)."""

from __future__ import annotations

from collections.abc import Callable

import mpmath
import sympy
import torch
from sympy.codegen.cfunctions import log1p

from codegen.printers import TORCH, KernelPrinter, PrintError
from codegen.runtime import triton_helpers
from derive.algebra import GuardedReciprocal
from derive.engine import Derivation
from derive.spec import Kind, Level, N, OpSpec, Rounded

#: what the printed torch source may name besides the row's values
_NAMESPACE = {"torch": torch, "helpers": triton_helpers, "float": float}


class Ties:
    """Counts, per kind of kink, the elements where torch's spelling met an exact tie."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, kind: str, hits: torch.Tensor) -> None:
        count = int(hits.sum())
        if count:
            self.counts[kind] = self.counts.get(kind, 0) + count


def torch_of(expr: sympy.Expr, env: dict[str, object], ties: Ties | None = None) -> object:
    """expr evaluated with torch's ops, each sympy function as its torch counterpart."""
    def go(e: sympy.Expr) -> object:
        return torch_of(e, env, ties)

    def like(value: object) -> torch.Tensor:
        return torch.as_tensor(value, dtype=env["acc"])

    if isinstance(e := expr, sympy.Symbol):
        return env[e.name]
    if e.is_Number:
        if e == sympy.oo:
            return float("inf")
        if e == -sympy.oo:
            return float("-inf")
        return float(e)
    if e.is_number and not e.free_symbols:
        return float(sympy.N(e, 30))
    if isinstance(e, sympy.Add):
        total = go(e.args[0])
        for arg in e.args[1:]:
            total = total + go(arg)
        return total
    if isinstance(e, sympy.Mul):
        product = go(e.args[0])
        for arg in e.args[1:]:
            product = product * go(arg)
        return product
    if isinstance(e, sympy.Pow):
        base, exponent = go(e.base), e.exp
        if exponent == sympy.Rational(1, 2):
            return torch.sqrt(like(base))
        if exponent == -sympy.Rational(1, 2):
            return 1 / torch.sqrt(like(base))
        if exponent.is_Integer and exponent < 0:
            return 1 / like(base) ** int(-exponent)
        return like(base) ** (int(exponent) if exponent.is_Integer else float(exponent))
    functions = {sympy.exp: torch.exp, sympy.log: torch.log, log1p: torch.log1p,
                 GuardedReciprocal: triton_helpers.guarded_reciprocal_torch,
                 sympy.tanh: torch.tanh,
                 sympy.erf: torch.erf, sympy.sin: torch.sin, sympy.cos: torch.cos,
                 sympy.sinh: torch.sinh, sympy.cosh: torch.cosh, sympy.Abs: torch.abs,
                 sympy.sign: torch.sign}
    if type(e) in functions:
        argument = like(go(e.args[0]))
        if ties is not None and type(e) in (sympy.Abs, sympy.sign):
            ties.add("abs", argument == 0)
        return functions[type(e)](argument)
    if isinstance(e, (sympy.Max, sympy.Min)):
        args = [like(go(a)) for a in e.args]
        args = list(torch.broadcast_tensors(*args))
        if ties is not None:
            top = torch.stack(args).amax(0) if isinstance(e, sympy.Max) else \
                torch.stack(args).amin(0)
            ties.add("max/min", sum((a == top).to(torch.int64) for a in args) > 1)
        if len(args) == 2:
            pair = torch.maximum if isinstance(e, sympy.Max) else torch.minimum
            return pair(*args)
        stacked = torch.stack(args)
        return stacked.amax(0) if isinstance(e, sympy.Max) else stacked.amin(0)
    if isinstance(e, sympy.Heaviside):
        argument = like(go(e.args[0]))
        at_zero = float(e.args[1]) if len(e.args) > 1 else 0.5
        if ties is not None:
            ties.add("heaviside", argument == 0)
        # torch.heaviside has no derivative; a step's is 0 on both sides and at the step
        return torch.where(argument > 0, like(1.0),
                           torch.where(argument < 0, like(0.0), like(at_zero))).detach()
    if isinstance(e, sympy.Piecewise):
        *cases, (otherwise, last) = e.args
        result = like(go(otherwise))
        for value, condition in reversed(cases):
            test = go(condition)
            result = torch.where(test, like(go(value)), result)
        return result
    if isinstance(e, sympy.core.relational.Relational):
        lhs, rhs = like(go(e.lhs)), like(go(e.rhs))
        if ties is not None and e.rel_op in ("<", ">", "<=", ">="):
            ties.add("piecewise", lhs == rhs)
        operator = {"<": torch.lt, ">": torch.gt, "<=": torch.le, ">=": torch.ge,
                    "==": torch.eq, "!=": torch.ne}[e.rel_op]
        return operator(lhs, rhs)
    if isinstance(e, sympy.And):
        tests = [go(a) for a in e.args]
        result = tests[0]
        for test in tests[1:]:
            result = result & test
        return result
    if isinstance(e, sympy.Or):
        tests = [go(a) for a in e.args]
        result = tests[0]
        for test in tests[1:]:
            result = result | test
        return result
    if isinstance(e, sympy.Mod):
        return go(e.args[0]) % int(e.args[1])
    if isinstance(e, Rounded):
        return like(go(e.args[0])).to(env["dtype"]).to(env["acc"])
    raise NotImplementedError(f"no torch spelling for {type(e).__name__}: {e}")


def _leaves(spec: OpSpec, inputs: dict[str, torch.Tensor], scalars: dict[str, float],
            acc: torch.dtype) -> dict[str, object]:
    """The spec's leaves: element inputs (M, N), column parameters (N,) as (1, N), scalars,
    learnable scalars (0-d), column indices and row inputs (M, 1)."""
    first = next(iter(inputs.values()))
    rows, width = first.shape
    env: dict[str, object] = {"acc": acc, "dtype": first.dtype, "N": width}
    for node in spec.nodes:
        if node.kind is Kind.INPUT:
            env[node.name] = inputs[node.name]
        elif node.kind is Kind.COLUMN_PARAM:
            env[node.name] = inputs[node.name][None, :]
        elif node.kind is Kind.SCALAR_PARAM:
            env[node.name] = inputs[node.name]
        elif node.kind is Kind.SCALAR:
            env[node.name] = torch.tensor(scalars[node.name], dtype=acc)
        elif node.kind is Kind.INDEX and node.level is Level.COLUMN:
            env[node.name] = torch.arange(width)[None, :]
        elif node.kind is Kind.ROW_INPUT:
            env[node.name] = inputs[node.name][:, None]
    return env


def spelled(spec: OpSpec, inputs: dict[str, torch.Tensor], scalars: dict[str, float],
            upstream: dict[str, torch.Tensor], ties: Ties | None = None
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(outputs, gradients) of the spec as written, by torch's ops and autograd, computed in the
    inputs' dtype. `upstream` holds d<output> per differentiated output."""
    leaves = {name: value.detach().clone().requires_grad_(
        spec.node(name).grad and spec.node(name).kind is not Kind.ROW_INPUT)
        for name, value in inputs.items()}
    first = next(iter(inputs.values()))
    rows, width = first.shape
    env = _leaves(spec, leaves, scalars, first.dtype)
    for node in spec.nodes:
        if not node.is_definition:
            continue
        value = torch.as_tensor(torch_of(node.expr, env, ties), dtype=first.dtype)
        if node.kind is Kind.REDUCE:
            body = value.broadcast_to((rows, width))
            if node.reduction == "sum":
                value = body.sum(-1, keepdim=True)
            elif node.reduction == "mean":
                value = body.sum(-1, keepdim=True) / width
            elif node.reduction == "max":
                value = body.amax(-1, keepdim=True)
            else:
                value = body.amin(-1, keepdim=True)
        elif node.level is Level.ROW:
            value = value.broadcast_to((rows, 1)) if value.dim() else value.expand(rows, 1)
        else:
            value = value.broadcast_to((rows, width))
        env[node.name] = value
    outputs = {name: env[name] for name in spec.outputs}
    pairing = sum((upstream["d" + name] * outputs[name]).sum()
                  for name in spec.outputs if "d" + name in upstream)
    wanted = [name for name, leaf in leaves.items() if leaf.requires_grad]
    grads = torch.autograd.grad(pairing, [leaves[n] for n in wanted], allow_unused=True)
    gradients = {name: torch.zeros_like(leaves[name]) if g is None else g
                 for name, g in zip(wanted, grads, strict=True)}
    return {k: v.detach() for k, v in outputs.items()}, gradients


def _run_graph(graph, env: dict[str, object], rows: int, width: int) -> None:
    """The graph's definitions evaluated into `env` by the torch printer's source."""
    elements = {name for name, value in env.items()
                if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] > 1}

    def varies(name: str) -> bool:
        return name in elements

    printer = KernelPrinter(TORCH, varies)

    def evaluate(expr: sympy.Expr) -> torch.Tensor:
        try:
            source = printer(expr)
        except PrintError:
            # a form outside the printer's tables (which their own tests cover): the same
            # value by torch's ops, so the math is still checked
            return torch.as_tensor(torch_of(expr, env), dtype=env["acc"])
        value = eval(source, {**_NAMESPACE, **env})  # noqa: S307 - printed by the engine
        return torch.as_tensor(value, dtype=env["acc"])

    for d in graph.definitions:
        value = evaluate(d.expr)
        if d.reduction:
            body = value.broadcast_to((rows, width))
            scale = evaluate(d.scale) if d.scale != 1 else 1.0
            if d.reduction == "sum":
                value = scale * body.sum(-1, keepdim=True)
            elif d.reduction == "max":
                value = scale * body.amax(-1, keepdim=True)
            else:
                value = scale * body.amin(-1, keepdim=True)
        elif d.level == "row":
            value = value.broadcast_to((rows, 1))
        else:
            value = value.broadcast_to((rows, width))
            elements.add(d.name)
        env[d.name] = value
    env["__evaluate__"] = evaluate


def derived(derivation: Derivation, inputs: dict[str, torch.Tensor],
            scalars: dict[str, float], upstream: dict[str, torch.Tensor]
            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(outputs, {memory mode: gradients}) of the engine's derivation, by the torch printer's
    source, computed in the inputs' dtype (the accumulator of the generated modules for fp32
    and fp64)."""
    spec = derivation.spec
    first = next(iter(inputs.values()))
    rows, width = first.shape
    acc = first.dtype
    env = _leaves(spec, inputs, scalars, acc)
    forward = derivation.forward
    _run_graph(forward, env, rows, width)
    evaluate = env.pop("__evaluate__")
    outputs = {}
    for name, expr in forward.element_outputs:
        outputs[name] = evaluate(expr).broadcast_to((rows, width))
    for name, expr in forward.row_outputs:
        outputs[name] = evaluate(expr).broadcast_to((rows, 1))
    saved = {**outputs}
    gradients = {}
    for mode, backward in derivation.backwards.items():
        keep = set(spec.modes[mode])
        back = _leaves(spec, inputs, scalars, acc)
        back = {k: v for k, v in back.items()
                if k in ("acc", "dtype", "N") or spec.node(k).kind is not Kind.INPUT
                or k in keep}
        back |= {k: v for k, v in saved.items() if k in keep}
        back |= {k: (v if v.dim() == 2 else v[:, None]) for k, v in upstream.items()}
        _run_graph(backward.graph, back, rows, width)
        evaluate = back.pop("__evaluate__")
        result = {}
        for name, expr in backward.gradients:
            node = spec.node(name)
            value = evaluate(expr)
            if node.kind is Kind.INPUT:
                result[name] = value.broadcast_to((rows, width))
            elif node.kind is Kind.COLUMN_PARAM:
                result[name] = value.broadcast_to((rows, width)).sum(0)
            else:
                result[name] = value.broadcast_to((rows, 1)).sum()
        gradients[mode] = result
    return outputs, gradients


def exact(spec: OpSpec, inputs: dict[str, torch.Tensor], scalars: dict[str, float],
          upstream: dict[str, torch.Tensor]
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(outputs, gradients) of the spec as written, rounded to fp64 (beyond its range: inf),
    at 50 digits more than exp of twice the largest input needs (1 - σ(x) at x = 1e3 is
    e^-1000, which 50 digits would round to 0), and more where a difference still rounds to 0.
    The gradients by forward mode, one leaf entry at a time, each node's partial derivatives
    SymPy's (a step's 0 where it is constant, a row max's through its largest element): exact
    away from ties. Row inputs and column indices are not supported (none is needed)."""
    rows, width = next(t for t in inputs.values() if t.dim() == 2).shape
    kinds = {node.name: (node.kind, node.level) for node in spec.nodes}
    def singular(e: sympy.Expr) -> bool:  # a step's derivative: 0 away from the step
        return isinstance(e, sympy.DiracDelta) or (
            isinstance(e, sympy.Derivative) and isinstance(e.expr, (sympy.sign, sympy.Heaviside)))

    compiled = {}
    for node in spec.nodes:
        if node.is_definition:
            arguments = sorted(node.expr.free_symbols, key=lambda s: s.name)
            partials = [sympy.diff(node.expr, a).replace(singular, lambda e: sympy.Integer(0))
                        for a in arguments]
            compiled[node.name] = (arguments,
                                   sympy.lambdify(arguments, node.expr, "mpmath"),
                                   [sympy.lambdify(arguments, d, "mpmath") for d in partials])

    def grid(level: Level, fill: object) -> object:
        if level is Level.ELEMENT:
            return [[fill] * width for _ in range(rows)]
        return [fill] * rows if level is Level.ROW else fill

    def at(values: dict, name: str, r: int, j: int) -> object:
        if name == "N":
            return width
        kind, level = kinds[name]
        value = values[name]
        if kind is Kind.COLUMN_PARAM:
            return value[j]
        if level is Level.ELEMENT:
            return value[r][j]
        return value[r] if level is Level.ROW else value

    def evaluate(seed: tuple[str, tuple[int, ...]] | None) -> tuple[dict, dict]:
        """The values, and their derivatives along one leaf entry (`seed`)."""
        values: dict = {}
        tangents: dict = {}
        zero = mpmath.mpf(0)
        for node in spec.nodes:
            name, (kind, level) = node.name, kinds[node.name]
            if kind is Kind.SCALAR:
                values[name], tangents[name] = mpmath.mpf(scalars[name]), zero
            elif kind is Kind.COLUMN_PARAM:
                values[name] = [mpmath.mpf(float(v)) for v in inputs[name].tolist()]
                tangents[name] = [zero] * width
            elif kind is Kind.SCALAR_PARAM:
                values[name], tangents[name] = mpmath.mpf(float(inputs[name])), zero
            elif kind is Kind.INPUT:
                values[name] = [[mpmath.mpf(v) for v in row] for row in inputs[name].tolist()]
                tangents[name] = grid(Level.ELEMENT, zero)
            if seed is not None and seed[0] == name:
                if kind is Kind.INPUT:
                    tangents[name][seed[1][0]][seed[1][1]] = mpmath.mpf(1)
                elif kind is Kind.COLUMN_PARAM:
                    tangents[name][seed[1][0]] = mpmath.mpf(1)
                else:
                    tangents[name] = mpmath.mpf(1)
            if not node.is_definition:
                continue
            arguments, function, partials = compiled[name]

            def local(r: int, j: int, arguments=arguments, function=function,
                      partials=partials) -> tuple[object, object]:
                point = [at(values, a.name, r, j) for a in arguments]
                slope = mpmath.fsum(partial(*point) * at(tangents, a.name, r, j)
                                    for a, partial in zip(arguments, partials, strict=True))
                return function(*point), slope

            if kind is Kind.REDUCE:
                value, tangent = [], []
                for r in range(rows):
                    body = [local(r, j) for j in range(width)]
                    if node.reduction in ("max", "min"):
                        pick = (max if node.reduction == "max" else min)(
                            range(width), key=lambda j, body=body: body[j][0])
                        value.append(body[pick][0])
                        tangent.append(body[pick][1])
                    else:
                        scale = width if node.reduction == "mean" else 1
                        value.append(mpmath.fsum(v for v, _ in body) / scale)
                        tangent.append(mpmath.fsum(t for _, t in body) / scale)
                values[name], tangents[name] = value, tangent
            elif level is Level.ROW:
                pairs = [local(r, 0) for r in range(rows)]
                values[name], tangents[name] = [v for v, _ in pairs], [t for _, t in pairs]
            else:
                pairs = [[local(r, j) for j in range(width)] for r in range(rows)]
                values[name] = [[v for v, _ in row] for row in pairs]
                tangents[name] = [[t for _, t in row] for row in pairs]
        return values, tangents

    def as_tensor(value: object) -> torch.Tensor:
        rows_of = value if isinstance(value, list) else [value]
        return torch.tensor([[float(v) for v in row] if isinstance(row, list) else [float(row)]
                             for row in rows_of], dtype=torch.float64)

    largest = max(float(t.abs().max()) for t in inputs.values() if t.numel())
    digits = 50 + int(0.87 * largest)  # exp(2·largest): 2·log10(e) = 0.87 digits per unit
    while True:
        try:
            return _at_digits(digits, evaluate, as_tensor, spec, inputs, upstream, rows, width)
        except ZeroDivisionError:  # a difference rounded to 0 (1 - σ(x)): more digits
            digits *= 2


def _at_digits(digits: int, evaluate: Callable, as_tensor: Callable, spec: OpSpec,
               inputs: dict[str, torch.Tensor], upstream: dict[str, torch.Tensor], rows: int,
               width: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with mpmath.workdps(digits):
        values, _ = evaluate(None)
        outputs = {name: as_tensor(values[name]) for name in spec.outputs}
        weights = {name: value.tolist() for name, value in upstream.items()}
        gradients = {}
        for node in spec.nodes:
            if not node.grad or node.kind not in (Kind.INPUT, Kind.COLUMN_PARAM,
                                                  Kind.SCALAR_PARAM):
                continue
            shape = inputs[node.name].shape
            entries = [()] if not shape else [(j,) for j in range(width)] if len(shape) == 1 \
                else [(r, j) for r in range(rows) for j in range(width)]
            grad = []
            for entry in entries:
                _, tangents = evaluate((node.name, entry))
                total = mpmath.mpf(0)
                for output in spec.outputs:
                    dy, slope = weights["d" + output], tangents[output]
                    for r in range(rows):
                        if spec.node(output).level is Level.ELEMENT:
                            total += mpmath.fsum(mpmath.mpf(dy[r][j]) * slope[r][j]
                                                 for j in range(width))
                        else:
                            total += mpmath.mpf(dy[r][0]) * slope[r]
                grad.append(float(total))
            gradients[node.name] = torch.tensor(grad, dtype=torch.float64).reshape(shape)
        return outputs, gradients


def row_of(value: float | list[float], width: int, dtype: torch.dtype) -> torch.Tensor:
    """A (1, width) row holding `value` (a number, or values cycled over the row)."""
    values = value if isinstance(value, list) else [value]
    return torch.tensor([values[j % len(values)] for j in range(width)], dtype=dtype)[None, :]


__all__ = ["N", "Ties", "derived", "exact", "row_of", "spelled", "torch_of"]
