"""Where the host time of one small call goes: cProfile over many forward+backward calls.

    python -m benchmarks.host_profile [--op layernorm] [--rows 32] [--cols 1024]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import time

import torch


def host_micros(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def launcher_breakdown(module, x: torch.Tensor, calls: int) -> None:
    """Host µs of the backward's pieces, called directly on the main thread."""
    n = x.shape[-1]
    weight = torch.ones(n, device=x.device, dtype=x.dtype)
    bias = torch.zeros_like(weight)
    _, mean, rstd = module._layernorm_fwd(x, weight, bias, 1e-5, store_mean=True,
                                          store_rstd=True)
    dy = torch.randn_like(x)
    pieces = {
        "backward launcher (1 kernel + partials)": lambda: module._layernorm_bwd_default(
            dy, x, weight, bias, mean, rstd, store_dweight=True, store_dbias=True),
        "backward launcher, no param grads": lambda: module._layernorm_bwd_default(
            dy, x, weight, bias, mean, rstd, store_dweight=False, store_dbias=False),
        "forward launcher": lambda: module._layernorm_fwd(
            x, weight, bias, 1e-5, store_mean=True, store_rstd=True),
        "torch.empty((132, N)) + sum(0) + to": lambda: torch.empty(
            (132, n), device=x.device).sum(0).to(x.dtype),
    }
    for name, fn in pieces.items():
        print(f"  {name}: {host_micros(fn, calls):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--op", default="layernorm")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    module = importlib.import_module(f"generated.{args.op}")
    function = {"layernorm": "layer_norm", "rmsnorm": "rms_norm", "softmax": "softmax"}[args.op]
    call = getattr(module, function)
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    extra = () if args.op == "softmax" else ((args.cols,),)

    def step(backward: bool) -> None:
        y = call(x, *extra)
        if backward:
            y.backward(torch.ones_like(y))

    for backward in (False, True):
        for _ in range(20):
            step(backward)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            step(backward)
        torch.cuda.synchronize()
        micros = (time.perf_counter() - start) / args.calls * 1e6
        print(f"{args.op} {args.rows}x{args.cols} {'fwd+bwd' if backward else 'fwd'}: "
              f"{micros:.1f} us per call")
    if args.op != "softmax":
        # The same call through the torch.library op (what torch.compile sees) instead of the
        # autograd.Function that eager calls use: the registration's own host cost.
        op = getattr(torch.ops.vjpforge, args.op)
        scalars = (1e-5,) if args.op == "layernorm" else (1e-6, 0.0)
        params = (None, None) if args.op == "layernorm" else (None,)

        def library_step() -> None:
            outputs = op(x, *params, *scalars, "default")
            outputs[0].backward(torch.ones_like(outputs[0]))

        for _ in range(20):
            library_step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            library_step()
        torch.cuda.synchronize()
        micros = (time.perf_counter() - start) / args.calls * 1e6
        print(f"{args.op} {args.rows}x{args.cols} fwd+bwd via torch.ops.vjpforge: "
              f"{micros:.1f} us per call")
    if args.op == "layernorm":
        launcher_breakdown(module, x.detach(), args.calls)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        step(True)
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
