"""How a spec asks for its public PyTorch surface. Codegen picks a template per API kind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """A per-column parameter of the module. `init` is 'ones' or 'zeros'; `flag` is the
    constructor switch (besides elementwise_affine) that can turn it off, if any."""

    name: str
    init: str  # "ones" | "zeros", or for a scalar parameter the option holding its init value
    flag: str | None = None
    offset: str | None = None  # a scalar option added to the parameter; init keeps the sum
    scalar: bool = False  # a 0-d learnable scalar (a required argument of the function)


@dataclass(frozen=True)
class Option:
    """A keyword-only scalar option of the function and the module (beyond torch's API)."""

    name: str
    default: float
    module_only: bool = False  # a constructor argument only (an init value)
    #: a range the value must lie in: "probability" is [0, 1)
    check: str | None = None


@dataclass(frozen=True)
class Switch:
    """A keyword-only bool of the function that sets a spec scalar (causal -> window = 0)."""

    name: str
    scalar: str
    on: float
    off: float


@dataclass(frozen=True)
class Replaces:
    """A module of another library that ours stands in for in patch_model(): its class name
    (an fnmatch pattern), attribute values it must have (`when`), options for our module."""

    pattern: str
    options: tuple[tuple[str, float], ...] = ()
    when: tuple[tuple[str, str], ...] = ()


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

    kind = "normalized_shape"


@dataclass(frozen=True)
class DimAPI:
    """`function(input, dim=-1)` plus an nn.Module holding `dim`, as torch.softmax."""

    function: str
    module: str
    torch_function: str

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

    kind = "elementwise"


@dataclass(frozen=True)
class RowLossAPI:
    """`function(input, target, *, <options>, reduction="mean")` as torch.nn.functional.<name>:
    one loss per row of `input` (..., N) with an integer class `target` (...) per row; rows whose
    target is the `ignore` option weigh 0 and do not count in the mean. Plus an nn.Module."""

    function: str
    module: str
    torch_function: str
    target: str
    ignore: str
    options: tuple[Option, ...] = ()

    kind = "row_loss"


def api_mismatches(spec) -> list[str]:
    """What in `spec.api` does not match the spec's values, each as one sentence: a mismatch
    would otherwise surface only when the generated function is called (TypeError, NameError)."""
    from derive.spec import Kind  # the spec module imports nothing from here

    api = spec.api
    kinds = {node.name: node.kind for node in spec.nodes}
    scalars = [n.name for n in spec.nodes if n.kind is Kind.SCALAR]
    params = [n.name for n in spec.nodes if n.kind in (Kind.COLUMN_PARAM, Kind.SCALAR_PARAM)]
    inputs = [n.name for n in spec.nodes if n.kind is Kind.INPUT]
    options = [o.name for o in getattr(api, "options", ()) if not o.module_only]
    given = set(options) | {s.scalar for s in getattr(api, "switches", ())}
    problems = []
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
        if api.residual is not None and kinds.get(api.residual) is not Kind.INPUT:
            problems.append(f"residual '{api.residual}' is not an input of the spec")
    elif isinstance(api, DimAPI):
        if len(inputs) != 1 or params:
            problems.append("DimAPI takes one input and no parameters; the spec declares "
                            f"inputs {', '.join(inputs)} and parameters "
                            f"{', '.join(params) or 'none'}")
    elif isinstance(api, ElementwiseAPI):
        for name in params:
            if name not in api.call_params:
                problems.append(f"parameter '{name}' is not in the API's call_params")
        if len(api.inputs) != len(inputs):
            problems.append(f"the API names {len(api.inputs)} inputs ({', '.join(api.inputs)}); "
                            f"the spec declares {len(inputs)} ({', '.join(inputs)})")
        if api.dropout is not None and api.dropout not in options:
            problems.append(f"dropout '{api.dropout}' is not one of the API's options")
    elif isinstance(api, RowLossAPI):
        if kinds.get(api.target) is not Kind.ROW_INPUT:
            problems.append(f"target '{api.target}' is not a row_input of the spec")
        if api.ignore not in options:
            problems.append(f"ignore '{api.ignore}' is not one of the API's options")
    for name in scalars:
        if name not in given:
            problems.append(f"scalar '{name}' is set by no option of the API (options: "
                            f"{', '.join(sorted(given)) or 'none'}); add Option('{name}', ...)")
    for name in options:
        if name not in scalars:
            problems.append(f"option '{name}' is not a scalar of the spec (scalars: "
                            f"{', '.join(scalars) or 'none'})")
    return problems
