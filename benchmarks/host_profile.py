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

from codegen.runtime import checks, launch
from codegen.runtime.schedules import fixed_n


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
    _, mean, rstd = module._layernorm_fwd(x, weight, bias, 1e-5, 0.0, store_mean=True,
                                          store_rstd=True)
    dy = torch.randn_like(x)
    pieces = {
        "backward launcher (1 kernel + partials)": lambda: module._layernorm_bwd_default(
            dy, x, weight, bias, mean, rstd, 0.0, store_dweight=True, store_dbias=True),
        "backward launcher, no param grads": lambda: module._layernorm_bwd_default(
            dy, x, weight, bias, mean, rstd, 0.0, store_dweight=False, store_dbias=False),
        "forward launcher": lambda: module._layernorm_fwd(
            x, weight, bias, 1e-5, 0.0, store_mean=True, store_rstd=True),
        "torch.empty((132, N)) + sum(0) + to": lambda: torch.empty(
            (132, n), device=x.device).sum(0).to(x.dtype),
    }
    print_pieces(pieces, calls)


def print_pieces(pieces: dict, calls: int) -> None:
    """Host µs of each named zero-argument call; one that fails is reported, not fatal."""
    for name, fn in pieces.items():
        try:
            print(f"  {name}: {host_micros(fn, calls):.1f} us")
        except Exception as error:  # noqa: BLE001 - the breakdown is diagnostic
            print(f"  {name}: failed ({type(error).__name__}: {error})")


def forward_breakdown(module, x: torch.Tensor, calls: int) -> None:
    """Host µs of the layer-norm forward's pieces: the checks, the schedule, the allocations,
    Triton's JIT dispatch, its C launcher alone, and the module's direct launch."""
    import triton.language as tl

    x = x.detach()
    M, N = x.shape
    weight = torch.ones(N, device=x.device, dtype=x.dtype)
    bias = torch.zeros_like(weight)
    schedule = module.SCHEDULES.choose(M, N, False, "fwd", 1, x.element_size(), x.device)
    y = torch.empty_like(x)
    mean = torch.empty(M, device=x.device)
    rstd = torch.empty(M, device=x.device)
    kernel = module._layernorm_fwd_red if schedule.looped else module._layernorm_fwd_per
    args = (x, x.stride(0), weight, bias, y, y.stride(0), mean, rstd,
            *launch.fp32_pair(1e-5), *launch.fp32_pair(0.0), M, N)
    constexprs = dict(HAS_WEIGHT=True, HAS_BIAS=True, STORE_MEAN=True, STORE_RSTD=True,
                      ACC=tl.float32, ROWS=schedule.rows, BLOCK_N=schedule.block_n,
                      STAGES=schedule.stages, CHUNKS=schedule.chunks,
                      ONE_SWEEP=schedule.one_sweep, KEEP=schedule.keep, EVEN=schedule.even,
                      STRIDED=schedule.strided, REVERSE=schedule.reverse,
                      LAST_FIRST=schedule.last_first,
                      FIXED_N=fixed_n(schedule, M, N, x.stride(0), y.stride(0)))
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    grid = (schedule.programs,)

    compiled = kernel[grid](*args, **constexprs, num_warps=schedule.warps)
    stream = torch.cuda.current_stream().cuda_stream
    launch_args = (schedule.programs, 1, 1, stream, compiled.function, compiled.packed_metadata,
                   None, None, None, *args, *[constexprs[n] for n in kernel.arg_names[len(args):]])

    def argument_checks():
        checks.check_input("layer_norm", x)
        shape, _ = checks.check_normalized_shape("layer_norm", (N,), x)
        checks.check_param("layer_norm", "weight", weight, shape, x)
        checks.check_param("layer_norm", "bias", bias, shape, x)
        checks.check_eps("layer_norm", 1e-5, x.dtype)

    leaf = x.clone().requires_grad_()
    pieces = {
        "layer_norm, no grad (public)": lambda: module.layer_norm(x, (N,), weight, bias),
        "layer_norm, input requires grad (public)": lambda: module.layer_norm(
            leaf, (N,), weight, bias),
        "torch layer_norm, no grad": lambda: torch.nn.functional.layer_norm(x, (N,), weight, bias),
        "_layernorm_fwd (launcher)": lambda: module._layernorm_fwd(
            x, weight, bias, 1e-5, 0.0, store_mean=False, store_rstd=False),
        "argument checks": argument_checks,
        "SCHEDULES.choose (cached)": lambda: module.SCHEDULES.choose(
            M, N, False, "fwd", 1, x.element_size(), x.device),
        "torch.empty((M, N))": lambda: torch.empty((M, N), dtype=x.dtype, device=x.device),
        "kernel[grid](...): Triton JIT dispatch + launch": lambda: kernel[grid](
            *args, **constexprs, num_warps=schedule.warps),
        "compiled.run(...): Triton's C launcher alone (the floor)": lambda: compiled.run(
            *launch_args),
        "launch.launch(...): the runtime's direct launch (key, then the C launcher)": lambda: (
            launch.launch(kernel, grid, schedule.warps, None, *args, **constexprs)),
    }
    print_pieces(pieces, calls)


def launch_bound(module, calls: int) -> None:
    """Whether back-to-back bf16 4096x1024 layer-norm forwards keep the GPU busy: wall µs per
    call (host) against the kernel's own µs (CUDA events around many calls)."""
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros_like(weight)
    for label, fn in (
        ("vjpforge", lambda: module.layer_norm(x, (1024,), weight, bias)),
        ("vjpforge launcher (no checks)", lambda: module._layernorm_fwd(
            x, weight, bias, 1e-5, 0.0, store_mean=False, store_rstd=False)),
        ("torch", lambda: torch.nn.functional.layer_norm(x, (1024,), weight, bias)),
    ):
        wall = host_micros(fn, calls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        gpu = start.elapsed_time(end) * 1e3 / 200
        print(f"  {label} 4096x1024 bf16 forward: {wall:.1f} us per call back to back, "
              f"{gpu:.1f} us on the GPU (CUDA graph of 20 calls): "
              f"{'launch-bound' if wall > 1.1 * gpu else 'GPU-bound'}")


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

    torch_call = {"layernorm": torch.nn.functional.layer_norm,
                  "rmsnorm": torch.nn.functional.rms_norm,
                  "softmax": lambda x: torch.softmax(x, -1)}[args.op]

    def step(fn, backward: bool) -> None:
        y = fn(x, *extra)
        if backward:
            y.backward(torch.ones_like(y))

    for backward in (False, True):
        for label, fn in (("vjpforge", call), ("torch", torch_call)):
            for _ in range(20):
                step(fn, backward)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                step(fn, backward)
            torch.cuda.synchronize()
            micros = (time.perf_counter() - start) / args.calls * 1e6
            print(f"{label} {args.op} {args.rows}x{args.cols} "
                  f"{'fwd+bwd' if backward else 'fwd'} (input requires grad): "
                  f"{micros:.1f} us per call")
    if args.op != "softmax":
        # The same call through the torch.library op (what torch.compile sees) instead of the
        # autograd.Function that eager calls use: the registration's own host cost.
        op = getattr(torch.ops.vjpforge, args.op)
        # eps and weight_offset; rms_norm's casting mode "llama" as its two rounding switches
        scalars = (1e-5, 0.0) if args.op == "layernorm" else (1e-6, 0.0, 1.0, 0.0)
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
        print("forward pieces:")
        forward_breakdown(module, x, args.calls)
        launch_bound(module, args.calls)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        step(call, True)
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
