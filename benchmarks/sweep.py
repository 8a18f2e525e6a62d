"""Sweep the schedule constants of the generated modules on a GPU and print what each costs.

    python -m benchmarks.sweep [--ops layernorm,rmsnorm,softmax] [--dtype bf16]

For each op and shape, every combination of the constants below is set on the generated
module's schedules (`SCHEDULES.override`: the rules read them at call time), the forward and
backward launchers are timed with triton.testing.do_bench (median, cold-ish L2 via its cache
flush), and the result is printed as GB/s with the same bytes model as benchmarks.run. The
per-op constants in codegen/schedule_table.json are chosen from these measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools

import torch
import triton.testing

from benchmarks.ops import OPS, bytes_moved, make_inputs
from codegen.runtime import checks

SHAPES = (
    (4096, 512),
    (4096, 1024),
    (4096, 4096),
    (8192, 8192),
    (4096, 16384),
    (4096, 32768),
    (32768, 256),
    (1024, 262144),
)
LARGE_SHAPES = ((4096, 32768), (1024, 262144), (4096, 16384))
#: `--large`: the looped-row schedule of wide rows
LARGE_CHOICES = {
    "looped_stages": (1, 2, 3),
    "looped_grid_stride_rows": (1, 2),
    "looped_block_n": (4096, 8192),
}
#: `--wide`: rows between two powers of two, whole in registers (padded to the next power of
#: two, measured table kept) or looped
WIDE_SHAPES = ((4096, 12288), (4096, 16384), (2048, 24576), (4096, 32768), (2048, 65536))
WIDE_CHOICES = {
    "persistent_max_block_n": (16384, 32768, 65536),
    "persistent_max_partial_row_bytes": (16384, 32768),
}
#: the schedule constants swept (`codegen.runtime.schedules.Constants` fields) and their values
CHOICES = {
    "row_block_elements": (2048, 8192),
    "programs_per_sm": (1, 4),
    "elements_per_warp": (256, 1024),
    "persistent_max_block_n": (16384, 65536),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


@contextlib.contextmanager
def module_constants(modules, constants: dict):
    """Each generated module's schedule `constants` (`Constants` field name -> value) in force
    until the block ends, then its own values back: `SCHEDULES.override` of each module, which
    forgets its schedules and launch plans both times (a plan would launch past the constants)."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(module.SCHEDULES.override(**constants))
        yield


def launcher_calls(op_name: str, module, m: int, n: int, dtype: torch.dtype):
    """Zero-argument calls of the module's forward and backward launchers at one shape (the
    launchers' own arguments: tensors, then scalars and flags; see generated/<op>.py), and the
    element size."""
    if op_name == "cross_entropy":
        return _cross_entropy_calls(module, m, n, dtype)
    if op_name in ADD_NORMS:
        return _add_norm_calls(op_name, module, m, n, dtype)
    if op_name == "masked_softmax":
        return _masked_softmax_calls(module, m, n, dtype)
    op = OPS[op_name]
    forward = getattr(module, f"_{op_name}_fwd")
    backward = getattr(module, f"_{op_name}_bwd_default")
    inputs = make_inputs(op, m, n, dtype, torch.device("cuda"))
    x = inputs.x.detach().reshape(m, n)
    params = [p.detach() for p in inputs.params]
    # RMS norm's: eps, weight offset, casting mode's switch (off: the default kernels)
    forward_scalars = {"layernorm": (1e-5,), "rmsnorm": (1e-6, 0.0, 0.0), "softmax": ()}[op_name]
    forward_flags = {"layernorm": 2, "rmsnorm": 1, "softmax": 0}[op_name]
    outs = forward(x, *params, *forward_scalars, *[True] * forward_flags)
    dy = torch.randn_like(x)
    if op_name == "softmax":
        saved, backward_scalars = (outs[0],), ()
    else:
        saved = (x, *params, *outs[1:])
        backward_scalars = (0.0, 0.0) if op_name == "rmsnorm" else ()
    stores = tuple(True for _ in params)

    def forward_call():
        # a training forward, as benchmarks.run times it: the row statistics are stored too
        # (tune --looped, H100, bf16 layer-norm forward 8192x8192 looped at 16 warps: 2784 GB/s
        # without them, 2487 with)
        return forward(x, *params, *forward_scalars, *[True] * forward_flags)

    def backward_call():
        return backward(dy, *saved, *backward_scalars, *stores)

    return forward_call, backward_call, x.element_size()


#: the fused residual-add norms: their launchers' scalars after the tensors, forward (eps, and
#: RMS norm's weight offset and casting mode's switch) and backward (RMS norm's two)
ADD_NORMS = {"add_layernorm": ((1e-5,), ()), "add_rmsnorm": ((1e-6, 0.0, 0.0), (0.0, 0.0))}


def _add_norm_calls(op_name: str, module, m: int, n: int, dtype: torch.dtype):
    """launcher_calls of generated.add_layernorm / add_rmsnorm as a pre-norm transformer block
    runs them: h = x + residual kept as the residual stream (residual_out), y = norm(h); the
    backward takes the gradient of y and of the residual stream (4 activation-sized tensors)."""
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device="cuda", dtype=dtype)

    x, residual = randn(m, n), randn(m, n)
    params = [randn(n) * 0.1 + 1.0] + ([randn(n) * 0.1] if op_name == "add_layernorm" else [])
    forward_scalars, backward_scalars = ADD_NORMS[op_name]
    statistics = (True, True) if op_name == "add_layernorm" else (True,)
    launch_forward = getattr(module, f"_{op_name}_fwd")
    backward = getattr(module, f"_{op_name}_bwd_default")

    def forward_call():
        return launch_forward(x, residual, None, *params, *forward_scalars, True, *statistics)

    _y, residual_out, *stats = forward_call()
    dy, dresidual_out = randn(m, n), randn(m, n)
    stores = (False, *(True for _ in params))

    def backward_call():
        return backward(dy, dresidual_out, residual_out, None, *params, *stats,
                        *backward_scalars, *stores)

    return forward_call, backward_call, x.element_size()


#: the masked softmax as benchmarks.transformer_ops runs it: scale, dropout, no causal window
MASKED_SOFTMAX = {"scale": 0.125, "dropout_p": 0.1}


def _masked_softmax_calls(module, m: int, n: int, dtype: torch.dtype, device="cuda"):
    """launcher_calls of generated.masked_softmax as attention runs it: the m rows are
    (batch, 1 head, n queries) of n keys (one batch of m queries where n does not divide m), an
    additive (batch, 1, 1, n) mask read through its strides, dropout 0.1 drawn in the kernel; the
    forward stores p for the backward (3 activation-sized tensors each way)."""
    generator = torch.Generator(device).manual_seed(0)
    queries = n if m % n == 0 else m
    shape = (m // queries, 1, queries, n)
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    mask = torch.zeros((shape[0], 1, 1, n), device=device, dtype=dtype)
    mask[..., -n // 8:] = float("-inf")
    row_shape = checks.row_shape(shape)
    attention_mask = checks.broadcast_rows(mask, shape, row_shape)
    seed = checks.seed("masked_softmax", 0, x.device)
    rows = x.reshape(m, n)
    scale, dropout_p = MASKED_SOFTMAX["scale"], MASKED_SOFTMAX["dropout_p"]
    window = float("inf")

    def forward_call():
        return module._masked_softmax_fwd(rows, attention_mask, scale, window, dropout_p, seed,
                                          row_shape, store_p=True)

    _y, p = forward_call()
    dy = torch.randn((m, n), generator=generator, device=device, dtype=dtype)

    def backward_call():
        return module._masked_softmax_bwd_default(dy, p, scale, window, dropout_p, seed,
                                                  row_shape)

    return forward_call, backward_call, rows.element_size()


def _cross_entropy_calls(module, m: int, n: int, dtype: torch.dtype):
    """launcher_calls of generated.cross_entropy: logits (m, n) against random classes; the
    forward stores the row max and denominator, as training does."""
    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn((m, n), generator=generator, device="cuda", dtype=dtype)
    target = torch.randint(0, n, (m,), generator=generator, device="cuda")
    options = {"ignore_index": -100, "label_smoothing": 0.0, "lse_square_scale": 0.0,
               "softcap": 0.0}
    stores = {"store_z_loss": False, "store_token_accuracy": False,
              "store_predicted_tokens": False, "store_row_max": True, "store_denominator": True,
              "store_target_weight": True, "store_weight_mean": True}
    *_, row_max, denominator, target_weight, weight_mean = module._cross_entropy_fwd(
        x, None, target, **options, **stores)
    dloss = torch.full((m,), 1.0 / m, device="cuda")

    def forward_call():
        return module._cross_entropy_fwd(x, None, target, **options, **stores)

    def backward_call():
        return module._cross_entropy_bwd_default(x, None, dloss, target, row_max, denominator,
                                                 target_weight, weight_mean, **options)

    return forward_call, backward_call, x.element_size()


def sweep(op_name: str, dtype: torch.dtype, shapes=SHAPES, choices=CHOICES,
          keep_table: bool = False, show_each: bool = False) -> None:
    module = importlib.import_module(f"generated.{op_name}")
    op = OPS[op_name]
    schedules = module.SCHEDULES
    # the constants are the fallback of the measured table (benchmarks/tune.py): set it aside so
    # the widths it covers run on the constants under test (None: the table kept)
    table = None if keep_table else {}
    for m, n in shapes:
        forward_call, backward_call, element_size = launcher_calls(op_name, module, m, n, dtype)
        best = {}
        for values in itertools.product(*choices.values()):
            chosen = dict(zip(choices, values, strict=True))
            with schedules.override(measured=table, **chosen):
                try:
                    fwd_ms, bwd_ms = time_ms(forward_call), time_ms(backward_call)
                except Exception as error:  # noqa: BLE001 - report and go on
                    print(f"{op_name} {m}x{n} {values}: error {type(error).__name__}: {error}")
                    continue
            fwd = bytes_moved(op, "fwd", m, n, element_size) / fwd_ms / 1e6
            bwd = bytes_moved(op, "bwd", m, n, element_size) / bwd_ms / 1e6
            if show_each:
                print(f"  {op_name} {m}x{n} {chosen}: fwd {fwd:.0f} bwd {bwd:.0f} GB/s")
            for mode, gbps in (("fwd", fwd), ("bwd", bwd)):
                if gbps > best.get(mode, (0, None))[0]:
                    best[mode] = (gbps, values)
        with schedules.override(measured=table):  # the module's own constants
            fwd_ms, bwd_ms = time_ms(forward_call), time_ms(backward_call)
        default_fwd = bytes_moved(op, "fwd", m, n, element_size) / fwd_ms / 1e6
        default_bwd = bytes_moved(op, "bwd", m, n, element_size) / bwd_ms / 1e6
        names = ",".join(choices)
        print(
            f"{op_name} {m}x{n}: default fwd {default_fwd:.0f} bwd {default_bwd:.0f} GB/s; "
            f"best fwd {best['fwd'][0]:.0f} at {best['fwd'][1]}, "
            f"best bwd {best['bwd'][0]:.0f} at {best['bwd'][1]} ({names})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", default="layernorm,rmsnorm,softmax")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--large", action="store_true", help="sweep the looped-row schedule")
    parser.add_argument("--wide", action="store_true",
                        help="rows between powers of two: padded in registers or looped")
    args = parser.parse_args()
    for op_name in args.ops.split(","):
        if args.wide:
            sweep(op_name, DTYPES[args.dtype], WIDE_SHAPES, WIDE_CHOICES, keep_table=True,
                  show_each=True)
        elif args.large:
            sweep(op_name, DTYPES[args.dtype], LARGE_SHAPES, LARGE_CHOICES)
        else:
            sweep(op_name, DTYPES[args.dtype])


if __name__ == "__main__":
    main()
