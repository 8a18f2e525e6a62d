"""Strict printers from SymPy to kernel source: Triton, and plain torch, from one rule set.

Only what is in the tables prints; anything else raises PrintError naming the expression.
Row-invariant factors of a product print first, so `sum_dy / N * x_hat` divides once per row
(Python evaluates left to right) instead of once per element.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sympy
from sympy.codegen.cfunctions import log1p

from derive.algebra import GuardedReciprocal
from derive.spec import Detached, Rounded, is_language_power


class PrintError(ValueError):
    """An expression outside the printer's tables; `name` is the value it defines, if known."""

    def __init__(self, message: str, name: str | None = None,
                 offending: sympy.Expr | None = None):
        super().__init__(message)
        self.name = name
        self.offending = offending


@dataclass(frozen=True)
class Dialect:
    name: str
    functions: Mapping[type, str]
    sqrt: str
    where: str
    maximum: str
    minimum: str
    split_constants: bool
    #: appended to a where(): torch.where of two Python numbers is float32 whatever `acc` is
    where_cast: str = ""
    #: a reciprocal square root, `{}` its argument (empty: 1.0 / sqrt)
    rsqrt: str = ""
    #: an exponential, `{}` its argument (empty: the `functions` entry)
    exp: str = ""
    #: a quotient, `{}` its numerator and denominator (empty: `/`)
    divide: str = ""
    #: a value rounded to the input's dtype and back (`Rounded`), `{}` the value
    rounded: str = ""
    #: a value autograd must not differentiate (`Detached`), `{}` the value
    detached: str = "{}"
    #: both conditions, and either, `{}` each (empty: `&` and `|`)
    conjunction: str = ""
    disjunction: str = ""
    #: a number a switch's branch takes (`{}`), where the printer knows a tensor on the
    #: kernel's device (`{device}`)
    constant: str = "{}"
    #: a row sum (`{}`) divided by its scale's base (`{}`): `sum / N`, never `1.0 / N * sum`,
    #: which is fp32
    sum_divide: str = "{} / {}"
    #: a number (`{}`) at the accumulator's precision, as the numerator of a quotient by
    #: integers alone (`1 / N`), which would otherwise be computed at the literal's (empty: the
    #: number as it prints)
    accumulated: str = ""


TRITON = Dialect(
    name="triton",
    functions={sympy.exp: "helpers.exp", sympy.log: "tl.log", sympy.erf: "tl.math.erf",
               sympy.tanh: "helpers.tanh", sympy.Abs: "tl.abs", sympy.sin: "tl.sin",
               sympy.cos: "tl.cos", GuardedReciprocal: "helpers.guarded_reciprocal",
               log1p: "helpers.log1p"},
    sqrt="helpers.sqrt",
    where="tl.where",
    maximum="tl.maximum",
    minimum="tl.minimum",
    split_constants=True,
    # correctly rounded unless the kernel is compiled for its row width (generated modules:
    # `helpers.rsqrt`, FIXED_N)
    rsqrt="helpers.rsqrt({}, FIXED_N)",
    # exact or fast by the kernel's element dtype (the kernel template's EXACT)
    exp="helpers.exp({}, EXACT)",
    divide="helpers.div({}, {}, EXACT)",
    # ROUND: the kernel's constexpr, its input's dtype (rounded as the kernel's stores round)
    rounded="({}).to(ROUND).to(ACC)",
    # as selections: Triton's interpreter cannot `|` a condition of scalars with a tensor's
    conjunction="tl.where({}, {}, False)",
    disjunction="tl.where({}, True, {})",
    # correctly rounded whatever the element dtype: a row statistic one ulp off (Triton's `/`
    # is div.full.f32) shifts every deviation from it, and a row of -1e4 then normalises to
    # 0.2 instead of 0 (once a row, so free)
    sum_divide="helpers.div({}, {}, True)",
    # a float literal and an int are fp32 to Triton: 1.0 / N, then an fp64 kernel's every use
    # of it, would be one fp32 rounding off
    accumulated="tl.full([], {}, ACC)",
)

TORCH = Dialect(
    name="torch",
    functions={sympy.exp: "torch.exp", sympy.log: "torch.log", sympy.erf: "torch.erf",
               sympy.tanh: "torch.tanh", sympy.Abs: "torch.abs", sympy.sin: "torch.sin",
               sympy.cos: "torch.cos", GuardedReciprocal: "helpers.guarded_reciprocal_torch",
               log1p: "torch.log1p"},
    sqrt="torch.sqrt",
    where="torch.where",
    maximum="torch.maximum",
    minimum="torch.minimum",
    split_constants=False,
    where_cast=".to(acc)",
    # the Triton printer's quotients, the same roundings (an element divided, not multiplied by
    # a rounded reciprocal): both paths compute the same values
    divide="({}) / ({})",
    rounded="({}).to(dtype).to(acc)",
    # a backward that autograd records (create_graph=True) differentiates the torch path
    detached="({}).detach()",
    # a tensor, as a value the torch path stores must be
    constant="torch.full((), {}, dtype=acc, device={device}.device)",
)

# Binding strength, for parentheses: atoms bind tightest.
_ADD, _MUL, _UNARY, _ATOM = 1, 2, 3, 4

_TRANSCENDENTAL = (sympy.exp, sympy.log, log1p, sympy.tanh, sympy.erf, sympy.sin, sympy.cos)


def _summation_rank(term: sympy.Expr) -> int:
    """Where a term goes in a printed sum, which Python adds left to right: numbers, then values
    with no transcendental function, then one such function alone, then products holding one.
    The terms that cancel come first, while their difference is still exact: a number and a
    saturating function (1 + t where tanh rounds to -1, 1 + erf(z)), values of the inputs'
    scale (row_max - x[target] of logits near 1e4); the smaller terms (log Σ exp, z·exp(-z²/2))
    are added to that difference, not to either of its large parts."""
    if term.is_number:
        return 0
    _, rest = term.as_coeff_Mul()
    if not rest.has(*_TRANSCENDENTAL):
        return 1
    return 2 if isinstance(rest, _TRANSCENDENTAL) else 3


def _enclosed(source: str) -> bool:
    """Whether source is one parenthesised group: "(a) & (b)" is not, "((a) & (b))" is."""
    if not source.startswith("("):
        return False
    depth = 0
    for index, character in enumerate(source):
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth == 0:
            return index == len(source) - 1
    return False


def _single(number: sympy.Expr) -> bool:
    """Whether float32 holds the number exactly."""
    value = float(sympy.N(number, 30))
    try:
        return struct.unpack("f", struct.pack("f", value))[0] == value
    except OverflowError:  # beyond float32's range
        return False


class KernelPrinter:
    """Prints one expression; `varies(name)` says whether a symbol changes along the row."""

    def __init__(self, dialect: Dialect, varies: Callable[[str], bool],
                 switches: Mapping[tuple[str, sympy.Expr], str] | None = None,
                 device: str | None = None):
        self.dialect = dialect
        self.varies = varies
        #: a tensor on the kernel's device, where a branch of a switch that is a number prints
        #: as the dialect's `constant`
        self.device = device
        #: (scalar, the value it takes when off) -> the flag that says it is on: a Piecewise
        #: condition Eq(scalar, value) prints as a Python conditional on the flag (a constexpr
        #: in a kernel), chosen at compile time
        self.switches = dict(switches or {})

    def __call__(self, expr: sympy.Expr) -> str:
        expr = sympy.sympify(expr)
        for (name, value), flag in self.switches.items():
            off = [c for c in expr.atoms(sympy.Eq, sympy.Ne)
                   if any(getattr(a, "name", None) == name for a in c.args)
                   and value in c.args]
            if off:
                # the expression as the spec reads with the scalar on, and off (its branches
                # chosen, the terms they drop gone: with it off, the expression the spec would
                # have without it), picked by the flag at compile time
                truth = {c: isinstance(c, sympy.Eq) for c in off}
                on, off_expr = expr.xreplace({c: not t for c, t in truth.items()}), \
                    expr.xreplace(truth)
                return f"({self._branch(on)} if {flag} else {self._branch(off_expr)})"
        return self._print(expr)[0]

    def _branch(self, expr: sympy.Expr) -> str:
        source = self(expr)
        if expr.is_number and self.device is not None:
            return self.dialect.constant.format(source, device=self.device)
        return source

    def scale_parts(self, scale: sympy.Expr) -> tuple[str, str]:
        """What prints before and after a row sum scaled by `scale` (not 1): the dialect's
        `sum_divide` by its base where it is a reciprocal, else a product."""
        base, exponent = sympy.sympify(scale).as_base_exp()
        if exponent == -1:
            before, after = self.dialect.sum_divide.split("{}", 1)
            return before, after.format(self(base))
        return f"{self(scale)} * ", ""

    # Each _print_* returns (source, binding strength).
    def _print(self, expr: sympy.Expr) -> tuple[str, int]:
        if isinstance(expr, sympy.Symbol):
            return expr.name, _ATOM
        if expr.is_Number or (expr.is_number and expr.is_real and not expr.free_symbols):
            return self._number(expr)
        if isinstance(expr, sympy.Add):
            return self._add(expr)
        if isinstance(expr, sympy.Mul):
            return self._mul(expr)
        if isinstance(expr, sympy.Pow):
            return self._pow(expr)
        if isinstance(expr, (sympy.Max, sympy.Min)):
            name = self.dialect.maximum if isinstance(expr, sympy.Max) else self.dialect.minimum
            source = self._print(expr.args[0])[0]
            for arg in expr.args[1:]:
                source = f"{name}({source}, {self._print(arg)[0]})"
            return source, _ATOM
        if isinstance(expr, sympy.Piecewise):
            return self._piecewise(expr)
        if isinstance(expr, sympy.Mod) and expr.args[0].is_integer \
                and expr.args[1].is_Integer and expr.args[1] > 0:
            # an integer's residue (the column index's parity): every dialect's % agrees with
            # SymPy's on the nonnegative integers an index takes
            return f"({self._wrap(expr.args[0], _MUL)} % {int(expr.args[1])})", _ATOM
        if isinstance(expr, Rounded):
            return self.dialect.rounded.format(self._print(expr.args[0])[0]), _ATOM
        if isinstance(expr, Detached):
            printed, precedence = self._print(expr.args[0])
            if self.dialect.detached == "{}":
                return printed, precedence
            return self.dialect.detached.format(printed), _ATOM
        if isinstance(expr, sympy.Function) and type(expr) in self.dialect.functions:
            args = ", ".join(self._print(a)[0] for a in expr.args)
            if type(expr) is sympy.exp and self.dialect.exp:
                return self.dialect.exp.format(args), _ATOM
            return f"{self.dialect.functions[type(expr)]}({args})", _ATOM
        if isinstance(expr, sympy.core.relational.Relational):
            lhs, rhs = self._wrap(expr.lhs, _ADD), self._wrap(expr.rhs, _ADD)
            return f"({lhs} {expr.rel_op} {rhs})", _ATOM
        if isinstance(expr, (sympy.And, sympy.Or, sympy.Not, sympy.ITE)) \
                or expr in (sympy.true, sympy.false):
            return self._boolean(expr), _ATOM
        raise PrintError(f"the {self.dialect.name} printer has no rule for "
                         f"{type(expr).__name__}: {expr} (the functions a spec may use: "
                         "docs/spec_language.md)", offending=expr)

    def _wrap(self, expr: sympy.Expr, strength: int) -> str:
        source, own = self._print(expr)
        return source if own >= strength else f"({source})"

    def _number(self, expr: sympy.Expr) -> tuple[str, int]:
        if expr == sympy.oo:
            return 'float("inf")', _ATOM
        if expr == -sympy.oo:
            return 'float("-inf")', _ATOM
        if not expr.is_finite:
            raise PrintError(f"cannot print the number {expr}")
        value = float(sympy.N(expr, 30))
        high = struct.unpack("f", struct.pack("f", value))[0]
        if self.dialect.split_constants and high != value:
            # Triton makes a float literal fp32: carry the rest in a second one, summed at ACC
            # (fp64 for fp64 tensors) so an irrational constant keeps full precision.
            low = value - high
            return f"(tl.full([], {high!r}, ACC) + tl.full([], {low!r}, ACC))", _ATOM
        text = repr(value)
        return text, (_UNARY if text.startswith("-") else _ATOM)

    def _add(self, expr: sympy.Add) -> tuple[str, int]:
        # Python adds left to right: the terms that cancel go first, while each is still exact.
        terms = sorted(expr.args, key=lambda t: (_summation_rank(t),
                                                 t.could_extract_minus_sign(),
                                                 not self._varies_expr(t),
                                                 sympy.default_sort_key(t)))
        pieces = []
        for term in terms:
            coefficient, rest = term.as_coeff_Mul()
            negative = coefficient.is_Number and coefficient < 0
            body = self._wrap(-term if negative else term, _MUL)
            if not pieces:
                pieces.append(f"-{body}" if negative else body)
            else:
                pieces.append(f" - {body}" if negative else f" + {body}")
        return "".join(pieces), _ADD

    def _mul(self, expr: sympy.Mul) -> tuple[str, int]:
        coefficient, rest = expr.as_coeff_Mul()
        if coefficient.is_Number and coefficient < 0:
            inner = self._wrap(-expr, _MUL)
            return f"-{inner}", _UNARY
        numerator, denominator = [], []
        # All numeric factors (sqrt(2), 1/sqrt(pi), 1/2, ...) print as one constant.
        constant = sympy.Mul(*(f for f in sympy.Mul.make_args(expr) if f.is_number))
        if constant != 1:
            numerator.append(constant)
        for factor in sympy.Mul.make_args(expr):
            if factor.is_number:
                continue
            base, exponent = factor.as_base_exp()
            if exponent.is_Number and exponent < 0 and not factor.is_Number:
                denominator.append(base if exponent == -1 else sympy.Pow(base, -exponent))
            else:
                numerator.append(factor)
        # Row-invariant factors first, each side, so Python's left-to-right evaluation keeps
        # them at row shape; elementwise factors multiply in last.
        invariant = [f for f in numerator if not self._varies_expr(f)]
        varying = [f for f in numerator if self._varies_expr(f)]
        invariant_den = [f for f in denominator if not self._varies_expr(f)]
        varying_den = [f for f in denominator if self._varies_expr(f)]
        if self.dialect.divide:
            # quotients as calls: the row-invariant one at row shape, then the elementwise
            # factors, then each elementwise divisor (x / den per element, as torch divides,
            # not x times a reciprocal: one rounding)
            # (a bare reciprocal of a row value divides the elementwise factors instead)
            alone = not invariant and varying
            source = self._product(invariant, [])
            if not alone and all(f.is_number for f in invariant):
                source = self._accumulated(source, invariant_den)
            source = self._quotient(source, [] if alone else invariant_den)
            product = self._product(varying, [])
            if product is not None:
                source = product if source is None else f"{source} * {product}"
            divisors = (invariant_den if alone else []) + varying_den
            return (self._quotient(source, divisors) or "1.0"), (
                _ATOM if divisors or (invariant_den and not varying) else _MUL)
        source = self._product(invariant, invariant_den)
        if varying or varying_den:
            tail = self._product(varying, varying_den, leading=source is None)
            source = tail if source is None else f"{source} * {tail}" if varying else \
                f"{source}{tail}"
        return (source or "1.0"), _MUL

    def _accumulated(self, number: str | None, denominator: list[sympy.Expr]) -> str | None:
        """`number` (1 where None), the numerator of a quotient by `denominator`, at the
        accumulator's precision where every divisor is made of integers alone (`1 / N`): the
        dialect's `accumulated`."""
        if not self.dialect.accumulated or not denominator or not all(
                s.is_integer for factor in denominator for s in factor.free_symbols):
            return number
        return self.dialect.accumulated.format(number or "1.0")

    def _quotient(self, source: str | None, denominator: list[sympy.Expr]) -> str | None:
        """source divided by each factor of denominator through the dialect's `divide`."""
        for factor in sorted(denominator, key=sympy.default_sort_key):
            source = self.dialect.divide.format(source or "1.0", self._print(factor)[0])
        return source

    def _product(self, numerator: list[sympy.Expr], denominator: list[sympy.Expr],
                 leading: bool = True) -> str | None:
        if not numerator and not denominator:
            return None
        ordered = sorted(numerator, key=sympy.default_sort_key)
        source = " * ".join(self._wrap(f, _MUL) for f in ordered) if ordered else None
        for factor in sorted(denominator, key=sympy.default_sort_key):
            divisor = self._wrap(factor, _UNARY)
            if source is None:
                source = f"1.0 / {divisor}" if leading else f" / {divisor}"
            else:
                source = f"{source} / {divisor}"
        return source

    def _pow(self, expr: sympy.Pow) -> tuple[str, int]:
        base, exponent = expr.args
        if exponent.is_Integer and exponent != 0:
            power = int(exponent)
            repeated = self._power(self._wrap(base, _UNARY), abs(power))
            if power < 0:
                if self.dialect.divide:
                    one = self._accumulated(None, [base]) or "1.0"
                    return self.dialect.divide.format(one, repeated), _ATOM
                return f"1.0 / ({repeated})" if abs(power) > 1 else \
                    f"1.0 / {self._wrap(base, _UNARY)}", _MUL
            return repeated, (_MUL if power > 1 else _ATOM)
        if is_language_power(exponent):
            # x**(n + f), f a sum of 1/2, 1/4, ...: x**n times nested square roots
            integer = abs(exponent.p) // exponent.q
            fraction = abs(exponent) - integer
            roots, root = [], self._print(base)[0]
            while fraction:
                root = f"{self.dialect.sqrt}({root})"
                fraction *= 2
                if fraction >= 1:
                    roots.append(root)
                    fraction -= 1
            source = " * ".join(([self._power(self._wrap(base, _UNARY), integer)]
                                 if integer else []) + roots)
            single = not integer and len(roots) == 1
            if exponent < 0:
                if single and exponent.q == 2 and self.dialect.rsqrt:
                    return self.dialect.rsqrt.format(self._print(base)[0]), _ATOM
                if self.dialect.divide:
                    return self.dialect.divide.format("1.0", source), _ATOM
                return (f"1.0 / {source}" if single else f"1.0 / ({source})"), _MUL
            return source, (_ATOM if single else _MUL)
        raise PrintError(f"the {self.dialect.name} printer has no rule for the power {expr}: "
                         "integer powers times square roots print (docs/spec_language.md)",
                         offending=expr)

    @staticmethod
    def _power(base: str, power: int) -> str:
        """base**power for power >= 1 as products, never a float pow: up to the fourth in a
        row, higher ones by squaring (b⁶ = (b·b·b)·(b·b·b), three roundings deep, not five); the
        compiler evaluates each repeated factor once."""
        if power <= 4:
            return " * ".join([base] * power)
        half = KernelPrinter._power(base, power // 2)
        square = f"({half}) * ({half})" if power // 2 > 1 else f"{half} * {half}"
        return f"{square} * {base}" if power % 2 else square

    def _piecewise(self, expr: sympy.Piecewise) -> tuple[str, int]:
        *cases, (last_value, last_condition) = expr.args
        if last_condition != sympy.true:
            raise PrintError(f"a Piecewise must end with an otherwise branch: {expr}")
        source = self._print(last_value)[0]
        otherwise = last_value
        for value, condition in reversed(cases):
            test = self._print(condition)[0]
            if self.dialect.where_cast and otherwise.is_number and value.is_number \
                    and not (_single(value) and _single(otherwise)):
                # torch.where of two Python numbers is float32: one of them a tensor of `acc`
                source = f"torch.full_like({test}, {source}, dtype=acc)"
            source = (f"{self.dialect.where}({test}, "
                      f"{self._print(value)[0]}, {source}){self.dialect.where_cast}")
            otherwise = sympy.Piecewise((value, condition), (otherwise, True))
        return source, _ATOM

    def _boolean(self, expr: sympy.Basic) -> str:
        """A condition: comparisons joined by the dialect's and/or (& and |, elementwise for a
        Python bool and a torch tensor alike; selections in Triton). A negation is pushed onto
        the comparisons (not (x < 6) is x >= 6); one of a condition a temporary holds is that
        value compared with 0 (Python's `not` fails on a tensor; `~` of a Python bool is -2)."""
        if expr == sympy.true:
            return "True"
        if expr == sympy.false:
            return "False"
        if isinstance(expr, sympy.ITE):
            # (a and b) or (not a and c), simplified where b or c is a constant
            return self._boolean(expr.to_nnf())
        if isinstance(expr, sympy.Not):
            inner = expr.args[0]
            if isinstance(inner, sympy.core.relational.Relational):
                return self._print(inner.negated)[0]
            if isinstance(inner, (sympy.And, sympy.Or, sympy.Not, sympy.ITE)):
                return self._boolean(expr.to_nnf())
            return f"({self._print(inner)[0]} == 0)"
        if isinstance(expr, (sympy.And, sympy.Or)):
            conjunction = isinstance(expr, sympy.And)
            form = self.dialect.conjunction if conjunction else self.dialect.disjunction
            first, *rest = sorted(expr.args, key=sympy.default_sort_key)
            if form:
                source = self._boolean(first)
                for term in rest:
                    source = form.format(source, self._boolean(term))
                return source
            joint = " & " if conjunction else " | "
            return "(" + joint.join(self._condition(t) for t in (first, *rest)) + ")"
        return self._print(expr)[0]

    def _condition(self, expr: sympy.Basic) -> str:
        """A condition as an operand of & or |, which bind tighter than comparisons:
        parenthesised unless it is a name or enclosed already."""
        source = self._boolean(expr)
        if isinstance(expr, sympy.Symbol) or _enclosed(source):
            return source
        return f"({source})"

    def _varies_expr(self, expr: sympy.Expr) -> bool:
        return any(self.varies(s.name) for s in expr.free_symbols)
