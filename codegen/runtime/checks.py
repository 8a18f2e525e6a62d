"""Argument checks shared by every generated API: each error names the argument, what was
expected and what was got."""

from __future__ import annotations

import functools
import math
import numbers

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: the tensor classes the checks' fast paths take as they are (any other, a subclass or a
#: fake tensor, goes through every check)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


# Errors of torch's types: where torch raises RuntimeError (or IndexError) for a bad argument,
# ours is an instance of that type too, and of the ValueError or TypeError it always was, so
# `except RuntimeError` written against torch and `except ValueError` both catch it.


class OptionError(ValueError, RuntimeError):
    """An argument's value outside what it may take, where torch raises RuntimeError."""


class ShapeError(ValueError, RuntimeError):
    """A tensor of the wrong shape (torch: RuntimeError)."""


class DeviceError(ValueError, RuntimeError):
    """A tensor on another device than the input's (torch: RuntimeError)."""


class DtypeError(TypeError, NotImplementedError):
    """A tensor of a dtype the function does not take (torch: RuntimeError, or for an input of a
    dtype its kernels lack NotImplementedError, itself a RuntimeError)."""


class DimError(ValueError, IndexError):
    """A dim out of the input's range (torch: IndexError)."""


class ClassIndexError(ValueError, IndexError):
    """A class index out of [0, classes) (torch: IndexError, "Target 7 is out of bounds")."""


def check_input(function, input, name="input"):
    if not isinstance(input, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor, got {type(input).__name__}"
        )
    if input.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument '{name}' must have dtype float16, bfloat16, float32 or "
            f"float64, got {input.dtype}"
        )


#: the parameter dtypes of torch's norms beyond layer_norm's rule (check_param), by function:
#: rms_norm multiplies the normalised input by the weight at its accumulator's precision
#: (float32 for a 16-bit input) whatever the weight's dtype, as the kernels read a parameter
ANY_PARAM_DTYPE = frozenset({"torch.nn.functional.rms_norm"})
#: torch functions whose parameters share one dtype (layer_norm's kernel refuses a float32
#: weight with a float16 bias for a float16 input)
ONE_PARAM_DTYPE = frozenset({"torch.nn.functional.layer_norm"})


def check_param(function, name, param, shape, input, promotes=False, torch_function=None,
                checked=None):
    """A per-column parameter of `shape`. A norm's weight and bias (`promotes=False`) leave the
    output in the input's dtype, as torch's norms, and take the dtypes its counterpart
    `torch_function` takes: the input's, or float32 for a 16-bit input (torch's layer_norm, and
    the rule of a norm without a torch counterpart); for those in ONE_PARAM_DTYPE also the dtype
    of the parameters `checked` before ({name: tensor or None}); for those in ANY_PARAM_DTYPE
    any real dtype (an integer or bool one is read as the accumulator's float, as torch does).
    A tensor added to the input (`promotes=True`: the bias of the layer before) may have any
    floating dtype and promotes with the input (`promote`)."""
    if param is None:
        return None
    # the common call at once (host time on every call): a contiguous parameter of the
    # input's dtype, device and of one dim that matches
    dtype = param.dtype if param.__class__ in _TENSORS else None
    if (dtype is input.dtype and len(shape) == 1
            and param.shape == shape and param.is_contiguous() and param.device == input.device):
        if checked is None:
            return param
        for other in checked.values():  # a loop, no generator: host time
            if other is not None and other.dtype is not dtype:
                break
        else:
            return param
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor or None, got "
            f"{type(param).__name__}"
        )
    if param.shape != shape:
        raise ShapeError(
            f"{function}(): argument '{name}' must have shape {shape} (normalized_shape), got "
            f"{tuple(param.shape)}"
        )
    if param.device != input.device:
        raise DeviceError(
            f"{function}(): argument '{name}' must be on the device of 'input' ({input.device}), "
            f"got {param.device}"
        )
    dtype = param.dtype
    if promotes:
        if dtype not in FLOAT_DTYPES:
            raise DtypeError(
                f"{function}(): argument '{name}' must have dtype float16, bfloat16, float32 or "
                f"float64, got {dtype}"
            )
    elif torch_function in ANY_PARAM_DTYPE:
        if dtype.is_complex:
            raise TypeError(
                f"{function}(): argument '{name}' must have a real dtype, got {dtype}"
            )
        if dtype not in FLOAT_DTYPES:
            # what torch multiplies by: the weight at the accumulator's precision
            param = param.to(torch.float64 if input.dtype == torch.float64 else torch.float32)
    elif dtype != input.dtype and not (
        dtype == torch.float32 and input.dtype in (torch.float16, torch.bfloat16)
    ):
        raise DtypeError(
            f"{function}(): argument '{name}' must have the dtype of 'input' ({input.dtype}), or "
            "float32 for a "
            f"float16/bfloat16 input, got {dtype}"
        )
    elif torch_function in ONE_PARAM_DTYPE:
        for other, tensor in (checked or {}).items():
            if tensor is not None and tensor.dtype != dtype:
                raise TypeError(
                    f"{function}(): argument '{name}' must have the dtype of '{other}' "
                    f"({tensor.dtype}), got {dtype}"
                )
    if param.dim() != 1:
        param = param.reshape(-1)
    # the kernels read a parameter's columns one element apart: a strided one (w[::2]) is copied
    return param if param.is_contiguous() else param.contiguous()


def check_pairing(function, name, input, pairing):
    """A last dim that the pairing of columns an op reads across can take: "half" and
    "interleaved" pair every column with another, so the width must be even."""
    columns = input.shape[-1] if input.dim() else 1
    if columns % 2:
        raise ShapeError(
            f"{function}(): argument '{name}' must have an even last dim (the {pairing!r} "
            f"pairing pairs column j with column "
            f"{'(j + N/2) mod N' if pairing == 'half' else 'j xor 1'}), got {columns} "
            f"(shape {list(input.shape)})"
        )


def check_like_input(function, name, tensor, input, reference="input"):
    if tensor is None:
        return None
    # the common call at once (host time on every call): the input's shape, dtype and device
    if (tensor.__class__ in _TENSORS and tensor.dtype is input.dtype
            and tensor.shape == input.shape and tensor.device == input.device):
        return tensor
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor or None, got "
            f"{type(tensor).__name__}"
        )
    if tensor.shape != input.shape:
        raise ShapeError(
            f"{function}(): argument '{name}' must have the shape of '{reference}' "
            f"{list(input.shape)}, got {list(tensor.shape)}"
        )
    if tensor.device != input.device:
        raise DeviceError(
            f"{function}(): argument '{name}' must be on the device of '{reference}' "
            f"({input.device}), got {tensor.device}"
        )
    if tensor.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument '{name}' must have dtype float16, bfloat16, float32 or "
            f"float64, got {tensor.dtype}"
        )
    return tensor


def check_scalar_param(function, name, param, input):
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor, got {type(param).__name__}"
        )
    if param.numel() != 1:
        raise ShapeError(
            f"{function}(): argument '{name}' must hold one value (shape () or (1,)), got shape "
            f"{tuple(param.shape)}"
        )
    if param.device != input.device:
        raise DeviceError(
            f"{function}(): argument '{name}' must be on the device of 'input' ({input.device}), "
            f"got {param.device}"
        )
    if param.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument '{name}' must have a floating dtype, got {param.dtype}"
        )
    return param.reshape(())


def check_normalized_shape(function, normalized_shape, input):
    # the common cases first: checks are host time on every call (one trailing dim, as an int or
    # a 1-tuple, that matches)
    kind = type(normalized_shape)
    if kind is int or (kind is tuple or kind is torch.Size) and len(normalized_shape) == 1:
        n = normalized_shape if kind is int else normalized_shape[0]
        if type(n) is int and input.dim() and input.shape[-1] == n:
            return (n,), n
    if type(normalized_shape) is int:
        shape = (normalized_shape,)
    elif type(normalized_shape) in (tuple, torch.Size) and all(
        type(d) is int for d in normalized_shape
    ):
        shape = tuple(normalized_shape)
    elif isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape = (int(normalized_shape),)
    elif isinstance(normalized_shape, (tuple, list, torch.Size)) and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in normalized_shape
    ):
        shape = tuple(int(d) for d in normalized_shape)
    else:
        raise TypeError(
            f"{function}(): argument 'normalized_shape' must be an int or a sequence of ints, got "
            f"{normalized_shape!r}"
        )
    if not shape:
        raise ShapeError(
            f"{function}(): argument 'normalized_shape' must have at least one dimension, got ()"
        )
    if input.dim() < len(shape) or input.shape[-len(shape) :] != shape:
        raise ShapeError(
            f"{function}(): argument 'normalized_shape' {list(shape)} must match the trailing "
            "dimensions of "
            f"'input', got input of shape {list(input.shape)}"
        )
    return shape, math.prod(shape)


def check_eps(function, eps, dtype):
    """eps as a float; None is the machine epsilon of the type torch computes `dtype` in (its
    opmath type: float32 for float16 and bfloat16 inputs), as torch.nn.functional.rms_norm."""
    if eps is None:
        return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    if type(eps) is float and 0.0 <= eps < float("inf"):
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(
            f"{function}(): argument 'eps' must be a real number or None, got {type(eps).__name__}"
        )
    eps = float(eps)
    if not eps >= 0.0 or eps == float("inf"):
        raise OptionError(f"{function}(): argument 'eps' must be finite and >= 0, got {eps}")
    return eps


def promote(*tensors):
    """The tensors (the first one given, None kept) cast to the dtype torch's arithmetic on them
    gives (torch.result_type's rule for floating tensors: the dimensioned ones decide, 0-d ones
    only where every tensor is 0-d). Only a mixed call casts: the kernels write the dtype of
    the tensors they read."""
    dtype = tensors[0].dtype
    for tensor in tensors:  # a loop: the common call, one dtype, returns at once (host time)
        if tensor is not None and tensor.dtype is not dtype:
            break
    else:
        return tensors
    present = [tensor for tensor in tensors if tensor is not None]
    deciding = [tensor.dtype for tensor in present if tensor.dim()] or [
        tensor.dtype for tensor in present
    ]
    dtype = functools.reduce(torch.promote_types, deciding)
    return tuple(
        tensor if tensor is None or tensor.dtype is dtype else tensor.to(dtype)
        for tensor in tensors
    )


def concrete(tensor) -> bool:
    """Whether `tensor`'s values exist to be read: not while torch.compile traces, nor for a meta
    tensor or a fake one (FakeTensorMode), which have a shape and a dtype but no values. A check
    of values runs only where this holds; the others check shapes and dtypes alone."""
    if tensor.is_meta or torch.compiler.is_compiling():
        return False
    # the common tensor first: host time on every call
    return type(tensor) is torch.Tensor or not is_fake(tensor)


def check_real(function, name, value):
    if value.__class__ is float and -math.inf < value < math.inf:
        return value  # the common call at once (host time on every call)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{function}(): argument '{name}' must be a real number, got {type(value).__name__}"
        )
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise OptionError(f"{function}(): argument '{name}' must be finite, got {value}")
    return value


def needs_grad(*tensors):
    """Whether the call goes through its autograd Function: autograd differentiates it in
    reverse mode (a tensor requires grad) or in forward mode (a tensor carries a tangent, which
    only the Functions pass on), or a torch.func transform is active."""
    if torch.is_grad_enabled():
        for tensor in tensors:  # a loop: any() over a generator takes twice the host time
            if tensor is not None and tensor.requires_grad:
                return True
    if forward_ad._current_level >= 0:  # a dual level is open
        for tensor in tensors:
            if tensor is not None and forward_ad.unpack_dual(tensor).tangent is not None:
                return True
    # torch.func transforms wrap the tensors: only the autograd Functions take them
    return torch._C._are_functorch_transforms_active()


def check_option(function, name, value, check, off=True):
    """A real number in the range `check` names (derive/api.py Option.check), as a float. With
    `off`, None passes a "positive" check: an op's option that is off unless given; a layer's
    option, which has no off value, passes off=False."""
    if value.__class__ is float and check == "probability" and 0.0 <= value < 1.0:
        return value  # the common call at once (host time on every call)
    if value is None and check == "positive" and off:
        return None  # the option is off (the kernels read its scalar's absent value, 0)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{function}(): argument '{name}' must be a real number, got {type(value).__name__}"
        )
    value = float(value)
    if check == "probability" and not 0.0 <= value < 1.0:
        raise OptionError(
            f"{function}(): argument '{name}' must be a probability in [0, 1), got {value}"
        )
    if check == "unit" and not 0.0 <= value <= 1.0:
        raise OptionError(f"{function}(): argument '{name}' must be in [0, 1], got {value}")
    if check == "positive" and not 0.0 < value < float("inf"):
        raise OptionError(
            f"{function}(): argument '{name}' must be a finite number > 0{' or None' * off}, "
            f"got {value}"
        )
    # comparisons, not math.isfinite: torch.compile(dynamic=True) passes a float it takes from
    # a function's defaults or a module's attributes as a symbolic float, which they trace
    if check == "finite" and not -math.inf < value < math.inf:
        raise OptionError(f"{function}(): argument '{name}' must be finite, got {value}")
    if check == "integer" and not value.is_integer():
        raise TypeError(f"{function}(): argument '{name}' must be an int, got {value}")
    return value


def check_size(function, name, value):
    """A count or a width: an int > 0 (a bool or a float raises TypeError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{function}(): argument '{name}' must be an int, got {type(value).__name__}"
        )
    if value <= 0:
        raise OptionError(f"{function}(): argument '{name}' must be > 0, got {value}")
    return int(value)


def check_flag(function, name, value):
    """A switch: a bool; any other type, an int included, raises TypeError."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{function}(): argument '{name}' must be a bool, got {type(value).__name__}"
        )
    return value


def check_hidden_states(function, name, tensor, hidden_size):
    """A layer's input: a floating (batch, seq, hidden_size) tensor."""
    check_input(function, tensor, name)
    if tensor.dim() != 3 or tensor.shape[-1] != hidden_size:
        raise ShapeError(
            f"{function}(): argument '{name}' must have shape (batch, seq, "
            f"hidden_size={hidden_size}), got {list(tensor.shape)}"
        )


def check_attention_mask(function, name, mask, hidden_states, num_heads):
    """A layer's attention mask: None, or a tensor broadcastable to the scores (batch,
    num_heads, seq, seq), bool (True = attend) or of the dtype of `hidden_states` (added to the
    scores)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor or None, got "
            f"{type(mask).__name__}"
        )
    if mask.dtype != torch.bool and mask.dtype != hidden_states.dtype:
        raise DtypeError(
            f"{function}(): argument '{name}' must be bool (True = attend) or have the dtype of "
            f"'hidden_states' ({hidden_states.dtype}; added to the scores), got {mask.dtype}"
        )
    batch, seq = hidden_states.shape[:2]
    scores = torch.Size((batch, num_heads, seq, seq))
    try:
        fits = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, scores) == scores
    except RuntimeError:
        fits = False
    if not fits:
        raise ShapeError(
            f"{function}(): argument '{name}' must broadcast to the attention scores (batch, "
            f"num_heads, seq, seq) = {list(scores)}, got shape {list(mask.shape)}"
        )


def check_seed(function, seed):
    """A given seed's type and range (an int in [0, 2**63), or a one-element int64 tensor);
    None passes."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, (numbers.Integral, torch.Tensor)):
        raise TypeError(
            f"{function}(): argument 'seed' must be an int or None, got {type(seed).__name__}"
        )
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64:
            raise ValueError(
                f"{function}(): argument 'seed' as a tensor must hold one int64, got "
                f"{seed.numel()} of {seed.dtype}"
            )
    elif not 0 <= seed < 2**63:
        raise ValueError(f"{function}(): argument 'seed' must be in [0, 2**63), got {seed}")


def seed(function, seed, device, draw=True):
    """The call's seed as a 0-d int64 tensor on the input's device (drawn from torch's generator
    of that device when None, so torch.manual_seed and activation checkpointing replay it).
    `draw=False` (dropout off: no mask is read) draws nothing where none is given, as torch's
    dropout draws nothing when off: every later random op gives what it gives without it."""
    if seed is None:
        if not draw:
            return torch.zeros((), dtype=torch.int64, device=device)
        return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)
    check_seed(function, seed)
    if isinstance(seed, torch.Tensor):
        return seed.reshape(()).to(device)
    return torch.tensor(seed, dtype=torch.int64, device=device)


def row_shape(shape):
    """The rows of an (..., D1, D2, N) tensor as [D0, D1, D2]: leading dims beyond three merge."""
    leading = [1, 1, 1] + list(shape[:-1])
    d0 = 1
    for size in leading[:-2]:
        d0 *= size
    return [d0, leading[-2], leading[-1]]


def leading_ones(tensor, dims):
    """`tensor` viewed with `dims` dims, the missing leading ones of size 1 (as broadcasting
    aligns it)."""
    if tensor.dim() >= dims:
        return tensor
    return tensor.reshape((1,) * (dims - tensor.dim()) + tuple(tensor.shape))


def broadcast_rows(tensor, shape, row_shape, order=None):
    """A (D0, D1, D2, N) view of a tensor broadcastable to `shape` once its dims are put in
    `order` (None: as given; `launch.memory_order`): broadcast dims keep stride 0 (read in
    place); only a broadcast last dim is made real, so rows have stride 1. Where its strides
    allow, the view is taken at once from the sizes and strides (one view op, not the four of
    aligning, permuting, expanding and merging: host time on every call); under torch.compile,
    where views cost nothing and a storage offset is not traced, by the tensor ops."""
    if not torch.compiler.is_compiling():
        view = _strided_rows(tensor, shape, order)
        if view is not None:
            return view
    tensor = leading_ones(tensor, len(shape))
    if order is not None:
        tensor = tensor.permute(order)
    if tensor.shape[-1] != shape[-1] or tensor.stride(-1) != 1:
        tensor = tensor.expand(*tensor.shape[:-1], shape[-1]).contiguous()
    return tensor.expand(shape).reshape(*row_shape, shape[-1])


def _strided_rows(tensor, shape, order):
    """`broadcast_rows`' view as one as_strided, or None where the last dim is not the rows'
    own (broadcast, or strided) or the leading dims beyond three do not merge into one."""
    geometry = remembered(_row_geometry, tensor.shape, tensor.stride(), shape, order)
    if geometry is None:
        return None
    return tensor.as_strided(*geometry, tensor.storage_offset())


def remembered(function, *args):
    """`function(*args)` through its lru_cache, or computed afresh where sizes may be symbolic
    (torch.compile, tracing), which no cache takes."""
    if torch.compiler.is_compiling():
        return function.__wrapped__(*args)
    try:
        return function(*args)
    except TypeError:  # a symbolic size has no hash
        return function.__wrapped__(*args)


@functools.lru_cache(maxsize=1024)
def _row_geometry(sizes, strides, shape, order):
    """The sizes and strides of `_strided_rows`' view, from the tensor's (a pure function of
    them, remembered: a model passes the same tables to every layer, host time on each call)."""
    dims = len(shape)
    sizes, strides = list(sizes), list(strides)
    if len(sizes) > dims:
        return None
    missing = dims - len(sizes)
    sizes, strides = [1] * missing + sizes, [0] * missing + strides
    if order is not None:
        sizes, strides = [sizes[d] for d in order], [strides[d] for d in order]
    if not dims or sizes[-1] != shape[-1] or strides[-1] != 1:
        return None
    strides = [stride if size != 1 else 0 for size, stride in zip(sizes, strides, strict=True)]
    lead, expected = 0, None  # the merged leading dims' stride, checked from the innermost
    for dim in range(dims - 4, -1, -1):
        if shape[dim] == 1:
            continue
        if expected is None:
            lead = strides[dim]
        elif strides[dim] != expected:
            return None
        expected = strides[dim] * shape[dim]
    merged = 1
    for size in shape[:-3]:
        merged *= size
    (d1, s1), (d2, s2) = [(shape[dim], strides[dim]) if dim >= 0 else (1, 0)
                          for dim in (dims - 3, dims - 2)]
    return (merged, d1, d2, shape[-1]), (lead, s1, s2, 1)


@functools.lru_cache(maxsize=1024)
def _broadcasts(shape, full) -> bool:
    """Whether a tensor of `shape` broadcasts to `full` without growing it (remembered, as
    `_row_geometry`)."""
    # `==` each, not `size in (1, whole)`: torch.compile's `in` takes a constant size (a
    # buffer's) for unequal to a symbolic one, where `==` guards on their values
    return len(shape) <= len(full) and all(
        size == 1 or size == whole for size, whole in zip(reversed(shape), reversed(full),
                                                          strict=False))


def check_broadcast(function, name, tensor, input, additive):
    """A tensor broadcastable to `input` (a bool one, for an additive mask, becomes 0 / -inf)."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{function}(): argument '{name}' must be a torch.Tensor or None, got "
            f"{type(tensor).__name__}"
        )
    if not remembered(_broadcasts, tensor.shape, input.shape):
        raise ShapeError(
            f"{function}(): argument '{name}' must be broadcastable to the shape of 'input' "
            f"{list(input.shape)}, got {list(tensor.shape)}"
        )
    if tensor.device != input.device:
        raise DeviceError(
            f"{function}(): argument '{name}' must be on the device of 'input' ({input.device}), "
            f"got {tensor.device}"
        )
    if tensor.requires_grad and torch.is_grad_enabled():
        raise OptionError(
            f"{function}(): argument '{name}' is not differentiated here and must not require "
            f"grad; pass {name}.detach()"
        )
    if additive and tensor.dtype == torch.bool:
        return torch.zeros(tensor.shape, dtype=input.dtype, device=input.device).masked_fill(
            ~tensor, float("-inf")
        )
    if tensor.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{function}(): argument '{name}' must have dtype float16, bfloat16, float32 or "
            f"float64{' or bool' if additive else ''}, got {tensor.dtype}"
        )
    return tensor


def check_choice(function, name, value, choices):
    """choices[value], where `value` is one of the keys of the dict `choices`; `value`, where
    `choices` is a tuple of them."""
    if value not in choices:
        raise ValueError(
            f"{function}(): argument '{name}' must be one of {', '.join(map(repr, choices))}, "
            f"got {value!r}"
        )
    return value if choices.__class__ is tuple else choices[value]


def check_mode(function, name, value, choices):
    """choices[value] for a str `value` among the keys of the dict `choices` (a `Choice` of the
    API: the numbers it gives the spec's scalars): another type raises TypeError, another str
    ValueError."""
    if not isinstance(value, str):
        raise TypeError(
            f"{function}(): argument '{name}' must be a str (one of "
            f"{', '.join(map(repr, choices))}), got {type(value).__name__}"
        )
    return check_choice(function, name, value, choices)


def check_variant(function, name, value, values):
    """A str argument that is one of `values` (torch's gelu `approximate`, a layer's attention
    kind): any other str raises OptionError (a RuntimeError, as torch's), a value of another
    type TypeError."""
    if not isinstance(value, str):
        raise TypeError(
            f"{function}(): argument '{name}' must be str, not {type(value).__name__}"
        )
    if value not in values:
        raise OptionError(
            f"{function}(): argument '{name}' must be one of {', '.join(map(repr, values))}, "
            f"got {value!r}"
        )
    return value
