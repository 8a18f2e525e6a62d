"""Activation memory and time of each LayerNorm memory mode, and the invertible mode's error.

    python -m benchmarks.memory_modes [--layers 24] [--batch 8] [--seq 512] [--hidden 1024]

A stack of `layers` blocks `h = linear(norm(h))` at BERT-large size (bf16). The linear layer
keeps its input, as every real consumer of a norm output does, so a mode that saves the norm's
output instead of its input (invertible) shares that tensor. Activation memory is
torch.cuda.max_memory_allocated during the forward minus what was allocated before it; time is
the median of CUDA-event-timed forward+backward steps. Also prints the bf16 error of each mode
against an fp64 reference, next to torch's own bf16 error.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from generated import layernorm

MODES = ("torch", "default", "recompute_mean", "invertible")


def norm(mode: str):
    if mode == "torch":
        return F.layer_norm
    return lambda h, shape, w, b: layernorm.layer_norm(h, shape, w, b, memory=mode)


def build(layers: int, hidden: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks = []
    for _ in range(layers):
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=generator)).to(dtype)
        bias = (0.1 * torch.randn(hidden, device="cuda", generator=generator)).to(dtype)
        linear = (torch.randn(hidden, hidden, device="cuda", generator=generator)
                  / hidden**0.5).to(dtype)
        blocks.append(tuple(t.requires_grad_() for t in (weight, bias, linear)))
    return blocks


def forward(mode: str, h: torch.Tensor, blocks) -> torch.Tensor:
    fn = norm(mode)
    for weight, bias, linear in blocks:
        h = F.linear(fn(h, (h.shape[-1],), weight, bias), linear)
    return h


def measure(mode: str, x: torch.Tensor, blocks, repeats: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = forward(mode, x, blocks)
    torch.cuda.synchronize()
    activation = torch.cuda.max_memory_allocated() - before
    out.float().square().mean().backward()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward(mode, x, blocks).float().square().mean().backward()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return activation / 2**20, statistics.median(times)


def bf16_errors(hidden: int) -> None:
    """Max abs error of output and gradients in bf16 vs fp64, per mode, on one norm."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4096, hidden, device="cuda", generator=generator)
    weight = 1 + 0.5 * torch.randn(hidden, device="cuda", generator=generator)
    bias = torch.randn(hidden, device="cuda", generator=generator)
    dy = torch.randn(4096, hidden, device="cuda", generator=generator)
    low = [t.to(torch.bfloat16) for t in (x, weight, bias, dy)]

    def run(mode: str, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(dtype).detach().requires_grad_() for t in low[:3]]
        y = norm(mode)(leaves[0], (hidden,), leaves[1], leaves[2])
        grads = torch.autograd.grad(y, leaves, low[3].to(dtype))
        return [y, *grads]

    exact = run("torch", torch.float64)
    names = ("y", "dx", "dweight", "dbias")
    print("| mode | " + " | ".join(f"{n} max abs err" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for mode in MODES:
        got = run(mode, torch.bfloat16)
        errors = [(g.double() - e).abs().max().item() for g, e in zip(got, exact, strict=True)]
        print(f"| {mode} | " + " | ".join(f"{e:.3g}" for e in errors) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dtype = torch.bfloat16
    blocks = build(args.layers, args.hidden, dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} x "
          f"(LayerNorm -> Linear), x {tuple(x.shape)} bf16\n")
    print("| mode | activation memory (MiB) | fwd+bwd step (ms) |")
    print("|---|---|---|")
    for mode in MODES:
        memory, ms = measure(mode, x, blocks, args.repeats)
        print(f"| {mode} | {memory:.0f} | {ms:.2f} |", flush=True)
    print()
    bf16_errors(args.hidden)


if __name__ == "__main__":
    main()
