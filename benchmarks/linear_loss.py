"""A language model's head and loss, forward + backward: `linear_cross_entropy` at several chunk
sizes against torch with the logits whole (`F.cross_entropy(F.linear(h, W).float(), t)`) and
Liger-Kernel's fused linear cross-entropy, in ms per step and the peak memory above what the
inputs and the previous step's gradients hold.

    python -m benchmarks.linear_loss [--heads 1536x151936,2048x256000,2048x32000]
                                     [--rows 4096] [--chunks default,256,1024,4096]
                                     [--reps 5] [--cpu-smoke]

bf16 on a CUDA GPU (`--cpu-smoke`: fp32 on the CPU, tiny sizes, wall clock: it tests the
harness; its numbers mean nothing). Prints one markdown table per head.
"""

from __future__ import annotations

import argparse
import time

CHUNKS = ("default", "256", "1024", "4096")
HEADS = ((1536, 151936), (2048, 256000), (2048, 32000))
SMOKE_HEADS = ((16, 40),)


def _timed(step, reps: int, cuda: bool) -> tuple[float, float | None]:
    """ms per call of step() after two untimed calls, and the peak GiB above the memory held
    before the timed calls (CUDA only)."""
    import torch

    for _ in range(2):
        step()
    if not cuda:
        began = time.perf_counter()
        for _ in range(reps):
            step()
        return (time.perf_counter() - began) * 1e3 / reps, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**30


def measure(rows: int, features: int, classes: int, chunks, reps: int, cuda: bool) -> list:
    """[(variant, ms, peak GiB or None)] for one head."""
    import torch
    import torch.nn.functional as F

    from generated.cross_entropy import linear_cross_entropy

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    generator = torch.Generator(device).manual_seed(0)
    h = (torch.randn(rows, features, generator=generator, device=device, dtype=dtype) * 0.5)
    w = (torch.randn(classes, features, generator=generator, device=device, dtype=dtype) * 0.02)
    h.requires_grad_()
    w.requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=generator, device=device)

    def step(loss):
        def run():
            h.grad = w.grad = None
            loss().backward()
        return run

    variants = [("torch, logits whole",
                 lambda: F.cross_entropy(F.linear(h, w).float(), target))]
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        pass
    else:
        if cuda:
            liger = LigerFusedLinearCrossEntropyLoss()
            variants.append(("liger", lambda: liger(w, h, target)))
    for chunk in chunks:
        size = None if chunk == "default" else int(chunk)
        variants.append((f"ours, chunk {chunk}", lambda size=size: linear_cross_entropy(
            h, w, target, chunk_size=size)))
    return [(name, *_timed(step(loss), reps, cuda)) for name, loss in variants]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default=None, help="HxV,... (default: three LM heads)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--chunks", default=",".join(CHUNKS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        parser.error("needs a CUDA GPU (or --cpu-smoke)")
    heads = ([tuple(map(int, head.split("x"))) for head in args.heads.split(",")]
             if args.heads else (HEADS if cuda else SMOKE_HEADS))
    rows = args.rows or (4096 if cuda else 24)
    chunks = [c.strip() for c in args.chunks.split(",") if c.strip()]
    if not cuda:
        chunks = [c if c == "default" else str(min(int(c), 8)) for c in chunks]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# {name}, torch {torch.__version__}, {rows} rows, forward + backward")
    for features, classes in heads:
        print(f"\n## head {features} x {classes}\n")
        print("| variant | ms | peak GiB above inputs |")
        print("|---|---:|---:|")
        for variant, ms, gib in measure(rows, features, classes, chunks, args.reps, cuda):
            print(f"| {variant} | {ms:.2f} | {'—' if gib is None else f'{gib:.2f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
