"""Where a generated op's forward+backward starts to cost less wall time than torch's own op:
back-to-back calls over a grid of sizes, bf16, inputs requiring grad, both in the same run.

    python -m benchmarks.crossover [--cols 768,2048,4096] [--rows 128,512,2048,8192,32768]
    python -m benchmarks.crossover --cpu-smoke      # tiny sizes on the CPU: tests the harness

Below the crossover a call is bound by host time (the Python autograd.Function, the argument
checks, the allocations and the Triton launch against torch's C++ dispatch); above it, by the
kernels' memory traffic, where the generated kernels are faster. Prints one markdown row per
(op, size): ours µs, torch µs, ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def wall_micros(fn, calls: int, repeats: int, sync) -> float:
    """Median over `repeats` of the wall µs per call of `calls` back-to-back calls."""
    times = []
    for _ in range(repeats):
        for _ in range(3):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def cases(M: int, N: int, device: str, dtype: torch.dtype) -> dict:
    """(ours, torch's) forward+backward of each op on (M, N) rows."""
    from generated import gelu, layernorm, rmsnorm, softmax, swiglu

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    x, u, w, b = leaf(M, N), leaf(M, N), leaf(N), leaf(N)
    g = torch.randn(M, N, device=device, dtype=dtype)
    return {
        "layer_norm": (lambda: layernorm.layer_norm(x, (N,), w, b).backward(g),
                       lambda: F.layer_norm(x, (N,), w, b).backward(g)),
        "rms_norm": (lambda: rmsnorm.rms_norm(x, (N,), w, 1e-6).backward(g),
                     lambda: F.rms_norm(x, (N,), w, 1e-6).backward(g)),
        "gelu": (lambda: gelu.gelu(x).backward(g), lambda: F.gelu(x).backward(g)),
        "gelu(x + bias)": (lambda: gelu.gelu(x, bias=b).backward(g),
                           lambda: F.gelu(x + b).backward(g)),
        "swiglu": (lambda: swiglu.swiglu(x, u).backward(g),
                   lambda: (F.silu(x) * u).backward(g)),
        "softmax": (lambda: softmax.softmax(x, -1).backward(g),
                    lambda: torch.softmax(x, -1).backward(g)),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cols", default="768,2048,4096")
    parser.add_argument("--rows", default="128,512,2048,8192,32768")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, dtype, sync = "cpu", torch.float32, lambda: None
        cols, rows, calls, repeats = (64,), (4, 16), 2, 1
    else:
        device, dtype, sync = "cuda", torch.bfloat16, torch.cuda.synchronize
        cols = tuple(int(c) for c in args.cols.split(","))
        rows = tuple(int(r) for r in args.rows.split(","))
        calls, repeats = args.calls, args.repeats
    results = []
    print("| op | rows x cols | ours µs | torch µs | ours / torch |")
    print("|---|---|---|---|---|")
    for N in cols:
        for M in rows:
            for name, (ours, reference) in cases(M, N, device, dtype).items():
                mine = wall_micros(ours, calls, repeats, sync)
                theirs = wall_micros(reference, calls, repeats, sync)
                results.append({"op": name, "rows": M, "cols": N, "ours_us": mine,
                                 "torch_us": theirs})
                print(f"| {name} | {M}x{N} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} |",
                      flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)
    return results


if __name__ == "__main__":
    main()
