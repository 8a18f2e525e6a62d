"""Transformer-block ops against torch eager, torch.compile, Liger-Kernel and Helion, in GB/s
and as a share of the copy bandwidth measured in the same run (Helion: SwiGLU and GeGLU).

    python -m benchmarks.transformer_ops [--dtype bf16] [--rep-ms 100] [--ops swiglu,geglu]
                                         [--cpu-smoke]

Ops and shapes (bf16 by default):
- bias_dropout_add, p = 0.1: rows x hidden in {4096x1024, 16384x4096, 8192x8192};
  bytes = fwd: read x, residual + write y (3X); bwd: read dy + write dx (2X; dresidual is dy);
- masked_softmax (B, H, S, S) with a (B, 1, 1, S) additive mask, scale, dropout 0.1:
  {8x16x512x512, 4x32x1024x1024, 1x32x4096x4096, causal 4x32x1024x1024};
  bytes = fwd: read x + write y + write p (3X); bwd: read dy, p + write dx (3X);
- cross_entropy, mean reduction, 5% ignored targets: rows x V in {4096x32000, 8192x128256,
  2048x256000}; bytes = fwd: read x (X); bwd: read x + write dx (2X);
- gelu and gelu_tanh with a bias: rows x N in {4096x4096, 8192x16384}; bytes = fwd: read x +
  write y (2X); bwd: read dy, x + write dx (3X);
- swiglu, geglu (silu / exact gelu of gate, times up): rows x N in {4096x11008, 8192x14336};
  bytes = fwd: read gate, up + write y (3X); bwd: read dy, gate, up + write dgate, dup (5X).
  Liger's geglu computes the tanh GELU (ours the exact one): its row is a reference;
  Helion (where it imports and a GPU is present): benchmarks/helion_ops.py's forward kernels,
  backward derived by helion.experimental.backward, autotune effort $VJPFORGE_HELION_EFFORT
  (default quick);
- add_layer_norm and add_rms_norm with prenorm (a pre-LN block's residual add: returns the norm
  of x + residual and the sum), eps 1e-6: rows x hidden in {4096x4096, 16384x4096, 8192x8192};
  bytes = fwd: read x, residual + write y, sum (4X); bwd: read dy, dsum, the saved sum + write
  dx (4X; dresidual is dx). Liger's fused_add_rms_norm (in_place=False: the upstream gradient
  is reused) is the same op for RMS norm; Liger has no fused add for layer norm.
Every provider is charged the same bytes; "vjpforge speed-up" is the provider's time over
ours. Timing: CUDA events, median after warm-up, the L2
flushed before each call (benchmarks/timing.py). torch.compile is compiled fresh per shape.
"""

from __future__ import annotations

import argparse
import datetime
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.environment import create_environment, measure_copy_bandwidth
from benchmarks.timing import Workload, measure
from generated.add_layernorm import add_layer_norm
from generated.add_rmsnorm import add_rms_norm
from generated.bias_dropout_add import bias_dropout_add
from generated.cross_entropy import cross_entropy
from generated.geglu import geglu
from generated.gelu import gelu
from generated.gelu_tanh import gelu_tanh
from generated.masked_softmax import masked_softmax
from generated.swiglu import swiglu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _liger_cross_entropy() -> Callable | None:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None
    return lambda x, t: liger_cross_entropy(x, t, ignore_index=-100)


def _liger(name: str) -> Callable | None:
    """liger_kernel.transformers.functional's `name`, or None without Liger."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    return getattr(functional, name, None)


def _helion(name: str) -> Callable | None:
    """benchmarks.helion_ops' `name` (a Helion forward, its backward derived by Helion), or
    None without helion or a CUDA GPU (its kernels are Triton)."""
    if not torch.cuda.is_available():
        return None
    try:
        from benchmarks import helion_ops
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return getattr(helion_ops, name)


def cases(smoke: bool):
    """(op, shape, make inputs, {provider: fn(*inputs)}, bytes fwd / bwd in X, elements)."""
    def torch_bda(x, residual, bias):
        return residual + F.dropout(x + bias, 0.1)

    def ours_bda(x, residual, bias):
        return bias_dropout_add(x, residual, bias=bias, p=0.1)

    shapes = [(64, 256)] if smoke else [(4096, 1024), (16384, 4096), (8192, 8192)]
    for m, n in shapes:
        def make(m=m, n=n, dtype=None, device=None):
            x = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
            residual = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
            bias = torch.randn(n, dtype=dtype, device=device, requires_grad=True)
            return x, residual, bias
        yield ("bias_dropout_add", f"{m}x{n}", make,
               {"vjpforge": ours_bda, "torch": torch_bda, "compile": torch_bda}, 3, 2, m * n)

    def torch_softmax(causal):
        def fn(x, mask):
            z = x * 0.125 + mask
            if causal:
                s = x.shape[-1]
                z = z.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device)
                                  .triu(1), float("-inf"))
            return F.dropout(torch.softmax(z, -1), 0.1)
        return fn

    def ours_softmax(causal):
        return lambda x, mask: masked_softmax(x, mask, scale=0.125, causal=causal,
                                              dropout_p=0.1)

    shapes = ([(1, 2, 64, 64, False)] if smoke else
              [(8, 16, 512, 512, False), (4, 32, 1024, 1024, False),
               (1, 32, 4096, 4096, False), (4, 32, 1024, 1024, True)])
    for b, h, q, k, causal in shapes:
        def make(b=b, h=h, q=q, k=k, dtype=None, device=None):
            x = torch.randn(b, h, q, k, dtype=dtype, device=device, requires_grad=True)
            mask = torch.zeros(b, 1, 1, k, dtype=dtype, device=device)
            mask[..., -k // 8:] = float("-inf")
            return x, mask
        label = f"{b}x{h}x{q}x{k}" + (" causal" if causal else "")
        yield ("masked_softmax", label, make,
               {"vjpforge": ours_softmax(causal), "torch": torch_softmax(causal),
                "compile": torch_softmax(causal)}, 3, 3, b * h * q * k)

    liger = _liger_cross_entropy()
    shapes = [(32, 1000)] if smoke else [(4096, 32000), (8192, 128256), (2048, 256000)]
    for m, v in shapes:
        def make(m=m, v=v, dtype=None, device=None):
            x = torch.randn(m, v, dtype=dtype, device=device, requires_grad=True)
            target = torch.randint(0, v, (m,), device=device)
            target[::20] = -100
            return x, target
        providers = {"vjpforge": lambda x, t: cross_entropy(x, t),
                     "torch": lambda x, t: F.cross_entropy(x, t),
                     "compile": lambda x, t: F.cross_entropy(x, t)}
        if liger is not None:
            providers["liger"] = liger
        yield ("cross_entropy", f"{m}x{v}", make, providers, 1, 2, m * v)

    gelus = {"gelu": (gelu, "none"), "gelu_tanh": (gelu_tanh, "tanh")}
    shapes = [(64, 256)] if smoke else [(4096, 4096), (8192, 16384)]
    for op, (ours, approximate) in gelus.items():
        for m, n in shapes:
            def make(m=m, n=n, dtype=None, device=None):
                x = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
                bias = torch.randn(n, dtype=dtype, device=device, requires_grad=True)
                return x, bias

            def theirs(x, b, approximate=approximate):
                return F.gelu(x + b, approximate=approximate)
            yield (op, f"{m}x{n}", make,
                   {"vjpforge": lambda x, b, ours=ours: ours(x, bias=b), "torch": theirs,
                    "compile": theirs}, 2, 3, m * n)

    glus = {"swiglu": (swiglu, F.silu, "liger_swiglu"), "geglu": (geglu, F.gelu, "liger_geglu")}
    shapes = [(64, 256)] if smoke else [(4096, 11008), (8192, 14336)]
    for op, (ours, activation, liger_name) in glus.items():
        for m, n in shapes:
            def make(m=m, n=n, dtype=None, device=None):
                gate = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
                up = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
                return gate, up

            def theirs(gate, up, activation=activation):
                return activation(gate) * up
            providers = {"vjpforge": ours, "torch": theirs, "compile": theirs}
            if (liger_fn := _liger(liger_name)) is not None:
                providers["liger"] = liger_fn
            if (helion_fn := _helion(op)) is not None:
                providers["helion"] = helion_fn
            yield (op, f"{m}x{n}", make, providers, 3, 5, m * n)

    def torch_add_norm(rms):
        def fn(x, residual, weight, bias=None):
            total = x + residual
            n = (x.shape[-1],)
            if rms:
                return F.rms_norm(total, n, weight, 1e-6), total
            return F.layer_norm(total, n, weight, bias, 1e-6), total
        return fn

    def ours_add_norm(rms):
        def fn(x, residual, weight, bias=None):
            n = (x.shape[-1],)
            if rms:
                return add_rms_norm(x, residual, n, weight, 1e-6, prenorm=True)
            return add_layer_norm(x, residual, n, weight, bias, 1e-6, prenorm=True)
        return fn

    liger_add_rms = _liger("liger_fused_add_rms_norm")
    shapes = [(64, 256)] if smoke else [(4096, 4096), (16384, 4096), (8192, 8192)]
    for op, rms in (("add_layer_norm", False), ("add_rms_norm", True)):
        for m, n in shapes:
            def make(m=m, n=n, rms=rms, dtype=None, device=None):
                x = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
                residual = torch.randn(m, n, dtype=dtype, device=device, requires_grad=True)
                params = [torch.randn(n, dtype=dtype, device=device, requires_grad=True)
                          for _ in range(1 if rms else 2)]  # weight (and bias)
                return x, residual, *params
            providers = {"vjpforge": ours_add_norm(rms), "torch": torch_add_norm(rms),
                         "compile": torch_add_norm(rms)}
            if rms and liger_add_rms is not None:
                providers["liger"] = (lambda x, residual, weight:
                                      liger_add_rms(x, residual, weight, 1e-6, in_place=False))
            yield (op, f"{m}x{n}", make, providers, 4, 4, m * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--ops", default="",
                        help="comma-separated ops to run (default: every op above)")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    env = create_environment(args.cpu_smoke)
    dtype = DTYPES[args.dtype]
    torch._dynamo.config.cache_size_limit = 1000
    copy = measure_copy_bandwidth(env, 1 << 30 if env.is_cuda else 1 << 22, 4 * args.rep_ms)
    element = torch.empty((), dtype=dtype).element_size()
    print(f"# {env.info.get('name', env.device)} {datetime.date.today()} torch {torch.__version__}"
          f" copy {copy.gbps:.0f} GB/s, {args.dtype}")
    print("| op | shape | mode | provider | ms | GB/s | % of copy | vjpforge speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    chosen = set(filter(None, args.ops.split(",")))
    if unknown := chosen - {case[0] for case in cases(args.cpu_smoke)}:
        parser.error(f"--ops: no such op {', '.join(sorted(unknown))}")
    for op, label, make, providers, fwd_x, bwd_x, elements in cases(args.cpu_smoke):
        if chosen and op not in chosen:
            continue
        inputs = make(dtype=dtype, device=env.device)
        results = {}
        for name, fn in providers.items():
            if name == "compile" and env.is_cuda:
                torch._dynamo.reset()
                fn = torch.compile(fn)
            outs = fn(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            upstream = tuple(torch.randn_like(o) if o.dim() else torch.ones_like(o)
                             for o in outs)
            leaves = [t for t in inputs if t.requires_grad]

            def forward(_state=None, fn=fn, inputs=inputs):
                return fn(*inputs)

            def backward(out, leaves=leaves, upstream=upstream):
                return torch.autograd.grad(out, leaves, upstream)

            for mode, work, bytes_x in (
                    ("fwd", Workload(call=forward), fwd_x),
                    ("fwd+bwd", Workload(call=lambda _s, f=forward, b=backward: b(f())),
                     fwd_x + bwd_x)):
                stats = measure(env.clock, work, args.rep_ms)
                gbps = bytes_x * elements * element / (stats.median_ms * 1e6)
                results[(name, mode)] = stats.median_ms
                print(f"| {op} | {label} | {mode} | {name} | {stats.median_ms:.3f} | "
                      f"{gbps:.0f} | {100 * gbps / copy.gbps:.0f}% | "
                      f"{stats.median_ms / results.get(('vjpforge', mode), math.nan):.2f}x |",
                      flush=True)
        del inputs
        env.release_memory()


if __name__ == "__main__":
    main()
