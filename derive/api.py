"""How a spec asks for its public PyTorch surface. Codegen picks a template per API kind."""

from __future__ import annotations

import ast
import dataclasses
import keyword
import types
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """A parameter of an op's module, per column: `init` is 'ones' or 'zeros'; `flag` is the
    constructor switch (besides elementwise_affine) that can turn it off, if any. Or of a layer
    (derive/blocks.py): of `shape`, `init` 'ones', 'zeros' or 'normal' (mean 0, `std`)."""

    name: str
    init: str  # "ones" | "zeros", or for a scalar parameter the option holding its init value
    flag: str | None = None
    offset: str | None = None  # a scalar option added to the parameter; init keeps the sum
    scalar: bool = False  # a 0-d learnable scalar (a required argument of the function)
    #: a layer's parameter: its shape and its normal init's standard deviation, expressions of
    #: the layer's options (derive/blocks.py)
    shape: tuple[object, ...] = ()
    std: object = None
    #: what the parameter is, for a layer's docs
    doc: str = ""


class Required:
    """The default of an option that has none (`REQUIRED`)."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: Option.default of a required argument: a layer's positional constructor argument
REQUIRED = Required()


@dataclass(frozen=True)
class Option:
    """A scalar option: a keyword-only argument of an op's function and module (beyond torch's
    API), or a constructor argument of a layer (derive/blocks.py)."""

    name: str
    #: None: the option is off unless given; its scalar must be declared absent=0 (the value
    #: the kernels then read) and its check "positive", so that no value given means off. A
    #: layer's option may also be REQUIRED, or default to a bool (a flag) or a str (a choice)
    default: float | bool | str | None | Required
    module_only: bool = False  # a constructor argument only (an init value)
    #: a range the value must lie in: "probability" is [0, 1), "unit" [0, 1], "positive"
    #: (0, inf), "finite" any finite number, "integer" an integer (codegen/runtime/checks.py
    #: check_option); a layer's option may also be a "size" (an int > 0) or a "flag" (a bool)
    check: str | None = None
    #: what the option does, for the function's docstring (elementwise and row-loss APIs)
    doc: str = ""
    #: an option beyond the torch function's arguments: keyword-only in a row-loss API's
    #: function and module, after torch's (whose signature is then kept as it is)
    keyword_only: bool = False
    #: a layer's str option: the values it takes
    choices: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class Switch:
    """A keyword-only bool of the function that sets a spec scalar (causal -> window = 0)."""

    name: str
    scalar: str
    on: float
    off: float


@dataclass(frozen=True)
class Choice:
    """A keyword-only str option of a NormalizedShapeAPI whose value sets spec scalars declared
    `absent=` (compile-time switches): `values` pairs each value with the numbers it gives
    `scalars`, in order. The first value is the default and gives every scalar its absent
    value, so that the default call runs the kernels compiled without them (RMSNorm's
    casting_mode)."""

    name: str
    scalars: tuple[str, ...]
    values: tuple[tuple[str, tuple[float, ...]], ...]
    #: what the option does, for the function's docstring
    doc: str = ""

    @property
    def default(self) -> str:
        return self.values[0][0]

    @property
    def table(self) -> str:
        """The value -> scalars dict, as Python source."""
        return "{" + ", ".join(f"{value!r}: ({''.join(f'{float(v)!r}, ' for v in numbers)})"
                               for value, numbers in self.values) + "}"


@dataclass(frozen=True)
class Variant:
    """A string argument whose values select the op that computes the call, as torch's
    `approximate` of gelu ("none" or "tanh"): `ops` maps each value to an op of derive/ops/,
    None for this op, which the first value (the default) must select. Another op's function
    is called with the call's other arguments, so its API takes the same ones. Any other value
    raises as torch does: RuntimeError, or TypeError for a value that is not a str. Keyword-only
    in the function (as torch's), the module's first constructor argument."""

    name: str
    ops: tuple[tuple[str, str | None], ...]

    @property
    def default(self) -> str:
        return self.ops[0][0]

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(value for value, _ in self.ops)

    @property
    def others(self) -> tuple[tuple[str, str], ...]:
        """(value, op) of the values another op computes."""
        return tuple((value, op) for value, op in self.ops if op is not None)


@dataclass(frozen=True)
class Replaces:
    """What this op stands in for in patch_model(). A candidate is found by `pattern` (an fnmatch
    pattern of its class name; of the model's class name for a loss) or, for an MLP, by its
    structure; it is swapped only if the op computes the same outputs on a probe input.

    `kind`: None for what the API implies ("norm" for a normalized-shape API, "activation" for
    an elementwise API of one input); "mlp": the gated MLP `down(act(gate(x)) * up(x))` whose
    `act(gate) * up` this op (inputs gate, up) computes; "loss": a Hugging Face causal-LM
    model's loss, or the cross-entropy a masked LM's forward takes itself, computed by this row
    loss; "residual": the residual add before a norm inside a
    transformer layer of a known structure (the pattern is of the layer's class name), fused
    with that norm by this add + norm op, whose parameters are those of the norm's own swap;
    "rotary": the `apply_rotary_pos_emb` an attention module's forward calls (the pattern is of
    the attention's class name), computed by this position-embedding API's embed function.
    `tries`: values of the API's options (or `Choice`s) tried in turn, such as an offset a
    parameter may carry: the first the probe finds exact (the module's own bits) is kept, else
    the first it accepts within the dtype's tolerance. The first value of each is the API's
    default (a patched module's label names the others)."""

    pattern: str
    kind: str | None = None
    tries: tuple[tuple[str, tuple[float | str, ...]], ...] = ()


#: what Replaces.kind may name besides None
REPLACES_KINDS = ("mlp", "loss", "residual", "rotary")


@dataclass(frozen=True)
class NormalizedShapeAPI:
    """`function(input, normalized_shape, <params>=None, eps=...)` plus an nn.Module, exactly as
    torch.nn.functional.<torch_name> and torch.nn.<module>.

    eps=None means the machine epsilon of the dtype torch computes the input in (float32 for
    float16 and bfloat16), as in torch.nn.functional.rms_norm.
    """

    function: str
    module: str
    torch_function: str
    torch_module: str
    params: tuple[Param, ...]
    eps: float | None
    options: tuple[Option, ...] = ()
    #: the spec input added to `input` (function argument after input), for fused add + norm:
    #: then `prenorm=True` also returns the sum, `residual_in_fp32=True` keeps it in fp32
    residual: str | None = None
    #: per-column tensors passed at each call (keyword-only), not owned by the module
    call_params: tuple[str, ...] = ()
    #: modules of other libraries this module stands in for in patch_model(), first match wins
    replaces: tuple[Replaces, ...] = ()
    #: the function and module take `in_place=False`: with True, the kernels' backward writes
    #: the input's gradient into the output gradient's memory wherever autograd hands that
    #: gradient to this backward alone (codegen/runtime/launch.py `overwritable`)
    in_place: bool = False
    #: the option that is a dropout probability on `input` (and its call_params) before the
    #: residual is added: the function takes `training` and `seed` as an ElementwiseAPI with
    #: dropout=... does, the module its training mode and `seed` at the call; outside training
    #: the probability is 0 (an exact identity)
    dropout: str | None = None
    #: keyword-only str options that set spec scalars (`Choice`)
    choices: tuple[Choice, ...] = ()
    #: the op of derive/ops/ that computes a call with dropout on (p > 0 in training), whose
    #: spec draws the mask and whose API takes the same arguments; this op's spec then has no
    #: random values and no scalar for the probability, so that its kernels stay those of the
    #: op without dropout (None: this spec draws the mask itself)
    dropout_op: str | None = None

    #: torch's expression of the same result, in the function's argument names as given (it
    #: runs before any check of them: torch checks them; `dispatch` is codegen.runtime.dispatch),
    #: run where it measured cheaper than the kernels (codegen/runtime/dispatch.py); None: never.
    #: An op that draws its own dropout mask applies torch's dropout in it, and runs it with
    #: dropout on too where the call gives no seed (any mask will do)
    reference: str | None = None
    #: a further condition, in the same names, for the calls `reference` computes exactly
    reference_when: str | None = None

    kind = "normalized_shape"


@dataclass(frozen=True)
class DimAPI:
    """`function(input, dim=-1)` plus an nn.Module holding `dim`, as torch.softmax."""

    function: str
    module: str
    torch_function: str

    #: torch's expression of the same result, in the function's argument names as given (it
    #: runs before any check of them: torch checks them; `dispatch` is codegen.runtime.dispatch),
    #: run where it measured cheaper than the kernels (codegen/runtime/dispatch.py); None: never
    reference: str | None = None
    #: a further condition, in the same names, for the calls `reference` computes exactly
    reference_when: str | None = None

    kind = "dim"


@dataclass(frozen=True)
class ElementwiseAPI:
    """`function(input, *, <params>=None)` over the last dim of any tensor, plus a module with no
    parameters (the per-column tensors, such as the bias of the previous linear layer, are
    passed at each call)."""

    function: str
    module: str
    torch_function: str
    call_params: tuple[str, ...] = ()
    replaces: tuple[Replaces, ...] = ()
    #: public names of the element inputs, in spec order (same shapes)
    inputs: tuple[str, ...] = ("input",)
    #: keyword-only scalar options of the function (constructor arguments of the module)
    options: tuple[Option, ...] = ()
    #: the option that is a dropout probability: the function takes `training` and `seed`,
    #: and outside training the probability is 0 (an exact identity)
    dropout: str | None = None
    #: bool keyword options that set a scalar of the spec
    switches: tuple[Switch, ...] = ()
    #: broadcast inputs that are additive masks: a bool tensor is taken as keep (0) / drop (-inf)
    additive_masks: tuple[str, ...] = ()
    #: a string argument whose values select this op or a sibling (torch's `approximate`)
    variant: Variant | None = None

    #: torch's expression of the same result, in the function's argument names as given (it
    #: runs before any check of them: torch checks them; `dispatch` is codegen.runtime.dispatch),
    #: run where it measured cheaper than the kernels (codegen/runtime/dispatch.py); None: never.
    #: An op that draws its own dropout mask applies torch's dropout in it, and runs it with
    #: dropout on too where the call gives no seed (any mask will do)
    reference: str | None = None
    #: a further condition, in the same names, for the calls `reference` computes exactly
    reference_when: str | None = None

    kind = "elementwise"


@dataclass(frozen=True)
class PositionEmbeddingAPI(ElementwiseAPI):
    """An ElementwiseAPI (`function(input, <tables>)` and its module) whose spec's other inputs
    are position tables broadcast over the input (cos and sin), plus `embed(<embedded>,
    <tables>, position_ids=None, unsqueeze_dim=1)` as Hugging Face's apply_rotary_pos_emb: each
    table unsqueezed at `unsqueeze_dim` (over the heads), the op applied to each embedded
    tensor with the same tables, the results returned as a tuple (q_embed, k_embed).
    `position_ids` is accepted and unused, as Hugging Face's."""

    #: the name of the Hugging Face-style function
    embed: str = "apply_rotary_pos_emb"
    #: its tensors the op is applied to, in order (each may have its own head count)
    embedded: tuple[str, ...] = ("q", "k")

    kind = "position_embedding"


@dataclass(frozen=True)
class RowLossAPI:
    """`function(input, target, weight=None, size_average=None, <ignore>=..., reduce=None,
    reduction="mean", <options>, *, <keyword_only options>, return_<name>=False,
    class_dim=None)` as torch.nn.functional.cross_entropy: one
    loss per row of the class dim (dim 1 of an input of 2 or more dims, as torch's; the last
    with class_dim=-1) with an integer class `target` per row; rows whose target is the `ignore`
    option weigh 0 and do not count in the mean. `weight`, if the spec takes class weights:
    the column_param (grad=False, absent=1) holding them, given as torch's `weight` argument;
    the mean then divides by the sum of the counted rows' target weights, as torch's. Plus an
    nn.Module holding the weights as a buffer, as torch.nn.<module>."""

    function: str
    module: str
    torch_function: str
    target: str
    ignore: str
    weight: str | None = None
    options: tuple[Option, ...] = ()
    #: per-row outputs of the spec declared grad=False that the function returns on request:
    #: `return_<name>=True` (after the options) returns (loss, <name>), <name> reduced as the
    #: loss is and never differentiated (a z-loss term, for logging)
    returns: tuple[str, ...] = ()
    #: what each of `returns` is, for the function's docstring: (name, text) pairs
    returns_doc: tuple[tuple[str, str], ...] = ()
    #: how a returned output is reduced, (name, how) pairs, "loss" where not named: "loss" as
    #: the loss (the mean divides by the counted rows' weight sum); "fraction", a 0/1 per row:
    #: "mean" its mean over the counted rows' count, "sum" its sum, "none" per row, always in
    #: the loss's precision (fp32, fp64); "index", a class per row, never reduced, int64
    returns_as: tuple[tuple[str, str], ...] = ()
    #: models whose loss this function computes in patch_model() (kind "loss")
    replaces: tuple[Replaces, ...] = ()
    #: (option, argument) pairs: an option that scales a per-row term of the loss linearly (a
    #: z-loss), whose mean over the rows a caller may define by their count where class
    #: weights divide the rest by their weight sum. The keyword-only `argument` takes
    #: "weight_sum" (the default: the term reduced as the rest of the loss) or "row_count"
    #: (with class weights and reduction="mean", the option is scaled by weight sum / count,
    #: both read on the host)
    count_means: tuple[tuple[str, str], ...] = ()

    #: torch's expression of the same result, in the function's argument names as given (it
    #: runs before any check of them: torch checks them; `dispatch` is codegen.runtime.dispatch),
    #: run where it measured cheaper than the kernels (codegen/runtime/dispatch.py); None: never
    reference: str | None = None
    #: a further condition, in the same names, for the calls `reference` computes exactly
    reference_when: str | None = None

    def returned_as(self, name: str) -> str:
        """How the returned output `name` is reduced (`returns_as`)."""
        return dict(self.returns_as).get(name, "loss")

    kind = "row_loss"


@dataclass(frozen=True)
class ReductionAPI:
    """`function(input, dim=-1, keepdim=False, *, <options>)` plus an nn.Module holding `dim`
    and `keepdim`, as torch.logsumexp: the spec's one value per row, for every slice of `input`
    along `dim` (a dim or a tuple of dims, reduced together as one row). The result has the
    input's shape without `dim` (kept as size 1 with keepdim=True) and the input's dtype."""

    function: str
    module: str
    torch_function: str
    #: keyword-only scalar options of the function (constructor arguments of the module)
    options: tuple[Option, ...] = ()

    #: torch's expression of the same result, in the function's argument names as given (it
    #: runs before any check of them: torch checks them; `dispatch` is codegen.runtime.dispatch),
    #: run where it measured cheaper than the kernels (codegen/runtime/dispatch.py); None: never
    reference: str | None = None
    #: a further condition, in the same names, for the calls `reference` computes exactly
    reference_when: str | None = None

    kind = "reduction"


#: every API kind, as codegen/templates/api_<kind>.py.j2 renders it
KINDS = (NormalizedShapeAPI, DimAPI, ElementwiseAPI, RowLossAPI, ReductionAPI,
         PositionEmbeddingAPI)

#: argument names each kind's function or module takes for itself: an option, switch or flag
#: of that name would be a duplicate argument of the generated code
_OWN_ARGUMENTS = {
    "normalized_shape": {"input", "normalized_shape", "eps", "memory", "prenorm",
                         "residual_in_fp32", "elementwise_affine", "device", "dtype", "in_place",
                         "training", "seed"},
    "dim": {"input", "dim"},
    "elementwise": {"training", "seed"},
    "position_embedding": {"training", "seed", "position_ids", "unsqueeze_dim"},
    "row_loss": {"input", "weight", "size_average", "reduce", "reduction", "class_dim"},
    "reduction": {"input", "dim", "keepdim"},
}

#: the generated module's own globals (its imports, SCHEDULES)
_GLOBALS = {"math", "numbers", "Optional", "torch", "triton", "tl", "checks", "launch",
            "helpers", "losses", "Constants", "Schedules", "fixed_n", "maxnreg", "SCHEDULES",
            "dispatch", "DISPATCH"}

#: the ways RowLossAPI.returns_as reduces a returned output
RETURNS_AS = ("loss", "fraction", "index")

#: the values of an op's Option.check (codegen/runtime/checks.py check_option)
CHECKS = (None, "probability", "unit", "integer", "positive", "finite")


def _type_mismatches(value: object, where: str) -> list[str]:
    """Each field of an API dataclass (and of the Params, Options, ... it holds) whose value is
    not of its declared type: `params=("w",)` for `params=(Param("w", "ones"),)`."""
    problems = []
    hints = typing.get_type_hints(type(value))
    for field in dataclasses.fields(value):
        got = getattr(value, field.name)
        name = f"{where}.{field.name}"
        if not _has_type(got, hints[field.name]):
            problems.append(f"{name} must be {_type_name(hints[field.name])}, got {got!r}")
            continue
        for item in got if isinstance(got, tuple) else (got,):
            if dataclasses.is_dataclass(item):
                problems += _type_mismatches(item, f"{name}[{type(item).__name__}"
                                                   f"('{getattr(item, 'name', '')}')]")
    return problems


def _has_type(value: object, hint: object) -> bool:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, argument) for argument in arguments)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return all(_has_type(item, arguments[0]) for item in value)
        return len(value) == len(arguments) and all(
            _has_type(item, argument) for item, argument in zip(value, arguments, strict=True))
    if hint is type(None):
        return value is None
    if hint is float:  # a number; a bool is not one
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: object) -> str:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(argument) for argument in arguments)
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return f"a tuple of {_type_name(arguments[0])}"
        return f"a tuple ({', '.join(_type_name(a) for a in arguments)})"
    if hint is type(None):
        return "None"
    return {str: "a str", float: "a number", bool: "a bool"}.get(hint, getattr(
        hint, "__name__", str(hint)))


def api_mismatches(spec) -> list[str]:
    """What in `spec.api` does not match the spec's values, each as one sentence: a mismatch
    would otherwise surface only when the generated module is imported or its function called
    (SyntaxError, TypeError, NameError)."""
    from derive.spec import Kind, Level  # the spec module imports nothing from here

    api = spec.api
    if not isinstance(api, KINDS):
        return [f"op.api must be one of {', '.join(k.__name__ for k in KINDS)}; got "
                f"{type(api).__name__}"]
    typed = _type_mismatches(api, type(api).__name__)
    if typed:
        return typed  # the checks below read the fields as their types say
    kinds = {node.name: node.kind for node in spec.nodes}
    scalars = [n.name for n in spec.nodes if n.kind is Kind.SCALAR]
    params = [n.name for n in spec.nodes if n.kind in (Kind.COLUMN_PARAM, Kind.SCALAR_PARAM)]
    inputs = [n.name for n in spec.nodes if n.kind is Kind.INPUT]
    row_inputs = [n.name for n in spec.nodes if n.kind is Kind.ROW_INPUT]
    outputs = [spec.node(name) for name in spec.outputs]
    all_options = list(getattr(api, "options", ()))
    options = [o.name for o in all_options if not o.module_only]
    switches = list(getattr(api, "switches", ()))
    choices = list(getattr(api, "choices", ()))
    given = set(options) | {s.scalar for s in switches} | {n for c in choices for n in c.scalars}
    problems = _names(api, set(kinds))
    if not inputs:
        problems.append("the spec declares no input (op.input(...)), which every API takes")
    absent = {n.name: n.absent for n in spec.nodes if n.kind is Kind.SCALAR}
    for c in choices:
        where = f"Choice('{c.name}')"
        if not c.values or any(len(numbers) != len(c.scalars) for _, numbers in c.values):
            problems.append(f"{where} needs values, each with one number per scalar")
        elif any(absent.get(n) is None or float(absent[n]) != float(v)
                 for n, v in zip(c.scalars, c.values[0][1], strict=True)):
            problems.append(f"{where}: its scalars {', '.join(c.scalars)} must be declared "
                            "absent=... in the spec, their absent values the first (default) "
                            "value's numbers: the default call runs the kernels without them")
        if len({value for value, _ in c.values}) != len(c.values) or not all(
                isinstance(value, str) for value, _ in c.values):
            problems.append(f"{where}: its values must be distinct strs")
    for o in all_options:
        if o.default is None:
            if o.check != "positive" or absent.get(o.name) != 0:
                problems.append(f"option '{o.name}' defaults to None (off), which needs "
                                "check='positive' and its scalar declared absent=0 (the "
                                "value the kernels read when it is off)")
        elif isinstance(o.default, bool) or not isinstance(o.default, (int, float)) \
                or o.default != o.default or abs(o.default) == float("inf"):
            problems.append(f"option '{o.name}' needs a finite number as its default, got "
                            f"{o.default!r}")
        if o.check not in CHECKS:
            problems.append(f"option '{o.name}' has check={o.check!r}; an op's checks are "
                            + ", ".join(map(repr, CHECKS)))
        if o.choices:
            problems.append(f"option '{o.name}' has choices, which only a layer's option "
                            "takes (an op's str option is a Choice)")
        if o.keyword_only and not isinstance(api, RowLossAPI):
            problems.append(f"option '{o.name}' is keyword_only, which only a RowLossAPI "
                            "reads (the other kinds' options are keyword-only already)")
        if o.module_only and not isinstance(api, NormalizedShapeAPI):
            problems.append(f"option '{o.name}' is module_only, which only a "
                            "NormalizedShapeAPI's scalar parameter init can use")
    if isinstance(api, NormalizedShapeAPI):
        given.add("eps")
        named = [p.name for p in api.params] + list(api.call_params)
        for name in params:
            if name not in named:
                problems.append(f"parameter '{name}' is not in the API's params or call_params")
        for name in named:
            if name not in params:
                problems.append(f"the API's parameter '{name}' is not a column_param or "
                                "scalar_param of the spec")
        module_options = [o.name for o in all_options if o.module_only]
        for p in api.params:
            wanted = Kind.SCALAR_PARAM if p.scalar else Kind.COLUMN_PARAM
            if p.name in params and kinds[p.name] is not wanted:
                problems.append(f"Param('{p.name}'{', scalar=True' * p.scalar}) needs a "
                                f"{wanted.value} in the spec; '{p.name}' is a "
                                f"{kinds[p.name].value}")
            if p.scalar and p.init not in module_options:
                problems.append(f"scalar Param('{p.name}') takes its init value from option "
                                f"'{p.init}', which is not a module_only option of the API")
            if not p.scalar and p.init not in ("ones", "zeros"):
                problems.append(f"Param('{p.name}') has init {p.init!r}; a column parameter "
                                "starts at 'ones' or 'zeros'")
            if p.shape or p.std is not None:
                problems.append(f"Param('{p.name}') has a shape or a std, which only a layer's "
                                "parameter takes (an op's is per column)")
            if p.offset is not None and p.offset not in options:
                problems.append(f"Param('{p.name}') has offset '{p.offset}', which is not an "
                                "option of the API")
        for name in api.call_params:
            if name in params and kinds[name] is not Kind.COLUMN_PARAM:
                problems.append(f"call_param '{name}' is a {kinds[name].value}; call_params "
                                "are column_params")
        if api.eps is not None and "eps" not in scalars:
            problems.append(f"the API sets eps={api.eps}, but the spec declares no scalar "
                            "'eps' (use eps=None, or declare op.scalar('eps'))")
        wanted_inputs = inputs[:1] + [api.residual] * bool(api.residual)
        if api.residual is not None and kinds.get(api.residual) is not Kind.INPUT:
            problems.append(f"residual '{api.residual}' is not an input of the spec")
        elif inputs != wanted_inputs:
            takes = "the input and the residual" if api.residual else "one input"
            problems.append(f"a NormalizedShapeAPI takes {takes}; the spec declares inputs "
                            f"{', '.join(inputs)}")
        if api.dropout is not None:
            if api.dropout not in options or not api.residual:
                problems.append(f"dropout '{api.dropout}' must be one of the API's options, on "
                                "an API with a residual (what is dropped is added to it)")
            elif api.dropout_op is not None:
                if api.dropout in scalars or any(n.kind is Kind.RANDOM for n in spec.nodes):
                    problems.append(f"dropout_op '{api.dropout_op}' computes the calls with "
                                    "dropout on; this spec draws no random values and has no "
                                    f"scalar '{api.dropout}'")
        elif api.dropout_op is not None:
            problems.append(f"dropout_op '{api.dropout_op}' is given without dropout=...")
        problems += _outputs(outputs, Level.ELEMENT, 2 if api.residual else 1,
                             "the normalized value and the sum" if api.residual else None)
    elif isinstance(api, DimAPI):
        if len(inputs) != 1 or params:
            problems.append("DimAPI takes one input and no parameters; the spec declares "
                            f"inputs {', '.join(inputs)} and parameters "
                            f"{', '.join(params) or 'none'}")
        problems += _outputs(outputs, Level.ELEMENT, 1)
    elif isinstance(api, ElementwiseAPI):
        for name in params:
            if name not in api.call_params:
                problems.append(f"parameter '{name}' is not in the API's call_params")
            elif kinds[name] is not Kind.COLUMN_PARAM:
                problems.append(f"call_param '{name}' is a {kinds[name].value}; an "
                                "ElementwiseAPI's call_params are column_params")
        for name in api.call_params:
            if name not in params:
                problems.append(f"call_param '{name}' is not a column_param of the spec")
        if len(api.inputs) != len(inputs):
            problems.append(f"the API names {len(api.inputs)} inputs ({', '.join(api.inputs)}); "
                            f"the spec declares {len(inputs)} ({', '.join(inputs)})")
        for name in api.additive_masks:
            if name not in api.inputs:
                problems.append(f"additive mask '{name}' is not one of the API's inputs "
                                f"({', '.join(api.inputs)})")
        if api.dropout is not None and api.dropout not in options:
            problems.append(f"dropout '{api.dropout}' is not one of the API's options")
        if api.variant is not None:
            problems += _variant_problems(api.variant, spec.name)
        problems += _outputs(outputs, Level.ELEMENT, 1)
        if isinstance(api, PositionEmbeddingAPI):
            problems += _position_problems(api, spec)
    elif isinstance(api, RowLossAPI):
        if kinds.get(api.target) is not Kind.ROW_INPUT:
            problems.append(f"target '{api.target}' is not a row_input of the spec")
        if api.ignore not in options:
            problems.append(f"ignore '{api.ignore}' is not one of the API's options")
        if api.weight is not None:
            node = spec.node(api.weight) if api.weight in kinds else None
            if node is None or node.kind is not Kind.COLUMN_PARAM or node.grad \
                    or node.absent != 1:
                problems.append(f"weight '{api.weight}' must be a column_param of the spec "
                                "declared absent=1, grad=False (class weights, 1 where not "
                                "given, never differentiated)")
        if len(inputs) != 1 or [p for p in params if p != api.weight]:
            problems.append("RowLossAPI takes one input and no parameters besides its weight; "
                            f"the spec declares inputs {', '.join(inputs)} and parameters "
                            f"{', '.join(params) or 'none'}")
        returned = [spec.node(name) for name in spec.undifferentiated]
        problems += _outputs([n for n in outputs if n.name not in spec.undifferentiated],
                             Level.ROW, 1)
        for name in api.returns:
            if name not in spec.undifferentiated or spec.node(name).level is not Level.ROW:
                problems.append(f"returns '{name}' is not a per-row output of the spec "
                                "declared grad=False")
        for node in returned:
            if node.name not in api.returns:
                problems.append(f"output '{node.name}' (grad=False) is not in the API's "
                                "returns")
        for name, how in api.returns_as:
            if name not in api.returns or how not in RETURNS_AS:
                problems.append(f"returns_as ('{name}', {how!r}): the name must be one of "
                                f"returns and the way one of {', '.join(RETURNS_AS)}")
    elif isinstance(api, ReductionAPI):
        if len(inputs) != 1 or params:
            problems.append("ReductionAPI takes one input and no parameters; the spec declares "
                            f"inputs {', '.join(inputs)} and parameters "
                            f"{', '.join(params) or 'none'}")
        problems += _outputs(outputs, Level.ROW, 1)
    for n in spec.nodes:
        if n.kind is Kind.COLUMN_PARAM and not n.grad and n.name != getattr(api, "weight", None):
            problems.append(f"column_param '{n.name}' is declared grad=False, which only a "
                            "RowLossAPI takes (as its weight=)")
    if spec.undifferentiated and not isinstance(api, RowLossAPI):
        problems.append(f"outputs declared grad=False ({', '.join(spec.undifferentiated)}) are "
                        "returned only by a RowLossAPI (its returns=)")
    target = getattr(api, "target", None)
    for name in row_inputs:
        if name != target:
            problems.append(f"row_input '{name}' is taken only as a RowLossAPI's target")
    nodes = spec.nodes
    if any(n.kind is Kind.RANDOM for n in nodes) and getattr(api, "dropout", None) is None:
        problems.append("random values are drawn from a seed, which only an ElementwiseAPI "
                        "or a NormalizedShapeAPI with dropout=... takes")
    if not isinstance(api, ElementwiseAPI):
        for n in nodes:
            if n.broadcast or (n.kind is Kind.INDEX and n.level is Level.ROW):
                what = "broadcast input" if n.broadcast else "row_index"
                problems.append(f"{what} '{n.name}' reads the input's leading dims, which "
                                "only an ElementwiseAPI passes")
    for s in switches:
        if s.scalar not in scalars:
            problems.append(f"switch '{s.name}' sets '{s.scalar}', which is not a scalar of "
                            f"the spec (scalars: {', '.join(scalars) or 'none'})")
        elif s.scalar in options:
            problems.append(f"scalar '{s.scalar}' is set both by option '{s.scalar}' and by "
                            f"switch '{s.name}'")
    problems.extend(replaces_mismatches(api))
    problems.extend(_reference(api))
    for name in scalars:
        if name not in given:
            problems.append(f"scalar '{name}' is set by no option of the API (options: "
                            f"{', '.join(sorted(given)) or 'none'}); add Option('{name}', ...)")
    # a dropout option whose calls another op computes is passed on to it, read by no kernel
    passed_on = {api.dropout} if getattr(api, "dropout_op", None) else set()
    for name in options:
        if name not in scalars and name not in passed_on:
            problems.append(f"option '{name}' is not a scalar of the spec (scalars: "
                            f"{', '.join(scalars) or 'none'})")
    return problems


def _position_problems(api: PositionEmbeddingAPI, spec) -> list[str]:
    """A position-embedding API's tables are the spec's broadcast inputs, passed as they are:
    no parameters, options, switches or dropout beside them."""
    from derive.spec import Kind  # the spec module imports nothing from here

    problems = []
    tables = api.inputs[1:]
    broadcast = {n.name for n in spec.nodes if n.broadcast}
    spec_inputs = [n.name for n in spec.nodes if n.kind is Kind.INPUT]
    if not tables or any(name not in broadcast for name in spec_inputs[1:]):
        problems.append("a PositionEmbeddingAPI's tables (the inputs after the first) must be "
                        "inputs of the spec declared broadcast=True")
    if api.call_params or api.options or api.switches or api.dropout or api.variant:
        problems.append("a PositionEmbeddingAPI takes no call_params, options, switches, "
                        "dropout or variant (its embed function passes none)")
    names = [api.embed, *api.embedded]
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
                or name in _GLOBALS:
            problems.append(f"{name!r} is not a name the embed function can take")
    if not api.embedded:
        problems.append("embedded names no tensor the op is applied to")
    clash = sorted(set(api.embedded) & set(tables) | {api.embed} & {api.function, api.module})
    if clash:
        problems.append(f"{', '.join(clash)} named twice among embed, embedded, tables, "
                        "function and module")
    return problems


def _reference(api) -> list[str]:
    """`reference` and `reference_when` are Python expressions (the generated function returns
    the first and tests the second)."""
    problems = []
    for role in ("reference", "reference_when"):
        text = getattr(api, role)
        if text is None:
            continue
        try:
            ast.parse(text, mode="eval")
        except SyntaxError as error:
            problems.append(f"{role} {text!r} is not a Python expression ({error.msg})")
    if api.reference is None and api.reference_when is not None:
        problems.append("reference_when is given without a reference")
    drop = getattr(api, "dropout", None)
    if (api.reference is not None and drop and not getattr(api, "dropout_op", None)
            and not _parsed_names(api.reference) & {drop}):
        # it runs with dropout on where no seed is given: it must drop as the kernels do
        problems.append(f"reference {api.reference!r} must apply dropout with '{drop}', "
                        f"as the op's kernels do (it runs with seed=None)")
    return problems


def _parsed_names(text: str) -> set[str]:
    """The names a Python expression reads (none where it does not parse)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def _names(api, values: set[str]) -> list[str]:
    """Names the generated code defines or takes as arguments: Python identifiers, none twice
    and none that the API kind takes for itself (`values`: the spec's names)."""
    problems = []
    for role in ("function", "module"):
        name = getattr(api, role)
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            problems.append(f"{role} {name!r} is not a Python identifier")
        elif name in _GLOBALS or name in _OWN_ARGUMENTS[api.kind] or name.startswith("_"):
            problems.append(f"{role} '{name}' is a name the generated module uses for itself")
        elif name in values:
            problems.append(f"{role} '{name}' is also a value of the spec, which the "
                            "function's body names")
    if api.function == api.module:
        problems.append(f"function and module are both named '{api.function}'")
    arguments = list(getattr(api, "inputs", ())) + list(getattr(api, "call_params", ()))
    arguments += [o.name for o in getattr(api, "options", ())]
    arguments += [f"return_{name}" for name in getattr(api, "returns", ())]
    arguments += [s.name for s in getattr(api, "switches", ())]
    arguments += [c.name for c in getattr(api, "choices", ())]
    arguments += [p.flag for p in getattr(api, "params", ()) if p.flag]
    if getattr(api, "variant", None) is not None:
        arguments.append(api.variant.name)
    own = _OWN_ARGUMENTS[api.kind]
    for name in arguments:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            problems.append(f"argument name {name!r} is not a Python identifier")
        elif name in own:
            problems.append(f"'{name}' is an argument that a {type(api).__name__} takes for "
                            "itself; choose another name (an option is named as its scalar)")
    for name in sorted({n for n in arguments if arguments.count(n) > 1}):
        problems.append(f"argument '{name}' is named twice")
    return problems


def _variant_problems(variant: Variant, op: str) -> list[str]:
    """What in a Variant the generated code could not act on (its ops are checked against
    their specs by `variant_mismatches`)."""
    if not isinstance(variant, Variant):
        return [f"variant must be a Variant, got {type(variant).__name__}"]
    where = f"Variant('{variant.name}')"
    values = [value for value, _ in variant.ops]
    if not values or variant.ops[0][1] is not None:
        return [f"{where}: its first value (the default) must select this op (None)"]
    problems = []
    for value, target in variant.ops:
        if not isinstance(value, str) or not value or not value.isprintable() \
                or any(c in value for c in "\"'\\{}"):
            problems.append(f"{where}: value {value!r} must be a non-empty str without quotes, "
                            "backslashes or braces (it is written into the generated code)")
        if target is not None and (not isinstance(target, str) or not target.isidentifier()
                                   or keyword.iskeyword(target) or target == op):
            problems.append(f"{where}: value {value!r} selects {target!r}, which must be the "
                            "name of another op (derive/ops/<name>.py), or None for this one")
    if sum(target is None for _, target in variant.ops) != 1:
        problems.append(f"{where}: exactly one value (the first) selects this op (None)")
    for value in sorted({v for v in values if isinstance(v, str) and values.count(v) > 1}):
        problems.append(f"{where}: value {value!r} is listed twice")
    return problems


def variant_mismatches(api, siblings: dict[str, object]) -> list[str]:
    """What in `api.variant` does not match the ops it selects (`siblings`: op name -> that
    op's API, None where no such op exists): each must exist and take the same arguments, as
    the call is passed on to its function unchanged."""
    variant = getattr(api, "variant", None)
    if variant is None:
        return []
    problems = []
    for value, op in variant.others:
        other = siblings.get(op)
        where = f"Variant('{variant.name}'): value {value!r} selects op '{op}'"
        if other is None:
            problems.append(f"{where}, which is not an op of derive/ops/")
            continue
        if type(other) is not type(api):
            problems.append(f"{where}, whose API is a {type(other).__name__}, not a "
                            f"{type(api).__name__}")
            continue
        if getattr(other, "variant", None) is not None:
            problems.append(f"{where}, which has a variant argument of its own")
        for field in ("inputs", "call_params", "dropout", "additive_masks"):
            if getattr(other, field) != getattr(api, field):
                problems.append(f"{where}, whose {field} {getattr(other, field)!r} differ from "
                                f"this op's {getattr(api, field)!r}")
        for field in ("options", "switches"):
            mine = [(o.name, o.default) if field == "options" else o.name
                    for o in getattr(api, field) if not getattr(o, "module_only", False)]
            theirs = [(o.name, o.default) if field == "options" else o.name
                      for o in getattr(other, field) if not getattr(o, "module_only", False)]
            if mine != theirs:
                problems.append(f"{where}, whose {field} {theirs!r} differ from this op's "
                                f"{mine!r}")
    return problems


def dropout_mismatches(api, siblings: dict[str, object]) -> list[str]:
    """What in `api.dropout_op` does not match the op it names (`siblings`: op name -> that op's
    API, None where no such op exists): the call is passed on to its function unchanged, so it
    takes the same arguments and draws the mask itself."""
    op = getattr(api, "dropout_op", None)
    if op is None:
        return []
    other = siblings.get(op)
    where = f"dropout_op '{op}'"
    if other is None:
        return [f"{where} is not an op of derive/ops/"]
    if not isinstance(other, NormalizedShapeAPI) or other.dropout != api.dropout \
            or other.dropout_op is not None:
        return [f"{where} needs a NormalizedShapeAPI with dropout='{api.dropout}' and no "
                "dropout_op of its own"]
    problems = []
    for field in ("params", "eps", "residual", "call_params", "in_place"):
        if getattr(other, field) != getattr(api, field):
            problems.append(f"{where}, whose {field} {getattr(other, field)!r} differ from this "
                            f"op's {getattr(api, field)!r}")
    mine = [(o.name, o.default) for o in api.options if not o.module_only]
    theirs = [(o.name, o.default) for o in other.options if not o.module_only]
    if mine != theirs:
        problems.append(f"{where}, whose options {theirs!r} differ from this op's {mine!r}")
    return problems


def _outputs(outputs: list, level, count: int, what: str | None = None) -> list[str]:
    """The outputs the API returns: `count` of them, each of `level` (outputs: the spec's
    output nodes)."""
    if len(outputs) != count or any(node.level is not level for node in outputs):
        per = "per-row" if level.value == "row" else "elementwise"
        what = what or f"{'one' if count == 1 else count} {per} output{'s' * (count > 1)}"
        found = ", ".join(f"'{node.name}' ({node.level.value})" for node in outputs)
        return [f"the API returns {what}; the spec outputs {found}"]
    return []


def replaces_kind(api, rule: Replaces) -> str | None:
    """The kind of swap `rule` declares for `api`: the one it names, else the one the API
    implies; None where the API implies none."""
    if rule.kind is not None:
        return rule.kind
    if isinstance(api, NormalizedShapeAPI):
        return "norm"
    if isinstance(api, ElementwiseAPI) and len(api.inputs) == 1:
        return "activation"
    return None


def replaces_mismatches(api) -> list[str]:
    """What in `api.replaces` patch_model() could not act on, each as one sentence."""
    problems = []
    # each option's default: a Choice's is its first value
    options = {o.name: o.default for o in getattr(api, "options", ())}
    options |= {c.name: c.default for c in getattr(api, "choices", ())}
    for rule in getattr(api, "replaces", ()):
        kind = replaces_kind(api, rule)
        where = f"Replaces({rule.pattern!r})"
        if rule.kind is not None and rule.kind not in REPLACES_KINDS:
            problems.append(f"{where}: kind must be None or one of {', '.join(REPLACES_KINDS)}, "
                            f"got {rule.kind!r}")
        elif kind is None:
            problems.append(f"{where}: a {api.kind} API implies no kind of swap; name one of "
                            f"{', '.join(REPLACES_KINDS)}")
        elif kind == "mlp" and not (isinstance(api, ElementwiseAPI) and len(api.inputs) == 2
                                    and not api.call_params and not api.switches
                                    and api.dropout is None):
            # options are left at their defaults in a swapped MLP
            problems.append(f"{where}: kind 'mlp' needs an elementwise API of two inputs "
                            "(gate, up), no call_params, switches or dropout")
        elif kind == "loss" and not isinstance(api, RowLossAPI):
            problems.append(f"{where}: kind 'loss' needs a row-loss API")
        elif kind == "rotary" and not isinstance(api, PositionEmbeddingAPI):
            problems.append(f"{where}: kind 'rotary' needs a position-embedding API")
        elif kind == "residual" and not (isinstance(api, NormalizedShapeAPI) and api.residual):
            problems.append(f"{where}: kind 'residual' needs a normalized-shape API with a "
                            "residual input")
        for name, values in rule.tries:
            if name not in options:
                problems.append(f"{where}: tries '{name}', which is not one of the API's options")
            elif values and values[0] != options[name]:
                problems.append(f"{where}: tries '{name}' from {values[0]!r}, not from its "
                                f"default {options[name]!r}")
            if not values:
                problems.append(f"{where}: tries no value of '{name}'")
    return problems
