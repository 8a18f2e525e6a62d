"""Host cost per call of every generated op against torch's native equivalent, in one run.

    python -m benchmarks.host [--ops layer_norm,softmax,...] [--dtype bf16] [--calls 200]
                              [--repeats 5] [--out FILE.json] [--cpu-smoke]

For each op, shape and mode (`fwd`: the forward; `fwd+bwd`: the forward and
`torch.autograd.grad` of every output), with inputs and parameters requiring grad:

- host µs: wall clock over `--calls` back-to-back calls with a device sync at both ends, divided
  by the calls; the median of `--repeats` such runs. Small calls are bound by the host: this is
  the time a training loop pays per call.
- GPU µs: the same call captured `GRAPH_CALLS` times in one CUDA graph, the graph replayed
  `GRAPH_REPLAYS` times between CUDA events: the device's own time per call, with no host
  in it. Where host µs exceeds it by more than `HOST_BOUND` the call is host-bound ("host"),
  otherwise GPU-bound ("GPU").

Ops (bf16 by default) and their torch equivalents:
  layer_norm (F.layer_norm, weight and bias), rms_norm (F.rms_norm, weight, eps 1e-6),
  add_layer_norm / add_rms_norm with prenorm=True (x + r, then F.layer_norm / F.rms_norm; the
  normalized output and the sum), dropout_add_layer_norm / dropout_add_rms_norm (the same with
  dropout p 0.1 on the input first: F.dropout(x) + r), softmax (torch.softmax), masked_softmax
  (scale 0.125, an additive padding mask broadcast over the rows, dropout 0.1:
  F.dropout(torch.softmax(x * scale + mask)), gelu (exact), gelu_tanh, swiglu (F.silu(gate) * up),
  geglu (F.gelu(gate) * up), geglu_tanh (F.gelu(gate, approximate="tanh") * up), bias_dropout_add
  (residual + F.dropout(x + bias), p 0.1), apply_rotary_pos_emb (transformers': q * cos +
  rotate_half(q) * sin and the same of k, q of the shape's width in heads of 128, k a quarter as
  many heads, cos and sin not differentiated), cross_entropy (mean, ignore_index -100 on 5% of
  the targets).
Shapes: 32x1024 and 8x512x1024; cross_entropy 32x32000 and 4096x32000 (rows x vocabulary).

Prints a markdown table per mode and writes every record to `--out` as JSON. `--cpu-smoke` runs
tiny shapes on the CPU (wall clock only, no GPU column; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.environment import DTYPES, names, user_level_setup
from generated.add_layernorm import add_layer_norm
from generated.add_rmsnorm import add_rms_norm
from generated.bias_dropout_add import bias_dropout_add
from generated.cross_entropy import cross_entropy
from generated.dropout_add_layernorm import dropout_add_layer_norm
from generated.dropout_add_rmsnorm import dropout_add_rms_norm
from generated.geglu import geglu
from generated.geglu_tanh import geglu_tanh
from generated.gelu import gelu
from generated.gelu_tanh import gelu_tanh
from generated.layernorm import layer_norm
from generated.masked_softmax import masked_softmax
from generated.rmsnorm import rms_norm
from generated.rotary import apply_rotary_pos_emb
from generated.softmax import softmax
from generated.swiglu import swiglu

MODES = ("fwd", "fwd+bwd")
PROVIDERS = ("ours", "torch")
GRAPH_CALLS = 10
"""Calls captured in one CUDA graph for the GPU time."""
GRAPH_REPLAYS = 5
HOST_BOUND = 1.1
"""Host µs above this multiple of the GPU µs: the call is host-bound."""
DROPOUT = 0.1
SCALE = 0.125
EPS = 1e-6
VOCAB = 32000
SHAPES = ((32, 1024), (8, 512, 1024))
#: the head width of apply_rotary_pos_emb's q and k (LLaMA's)
ROPE_HEAD_DIM = 128
CROSS_ENTROPY_ROWS = (32, 4096)
SMOKE_SHAPES = ((4, 64), (2, 8, 64))
SMOKE_CROSS_ENTROPY = ((4, 128), (16, 128))


@dataclass(frozen=True)
class Case:
    """One op at one shape: `make(device, dtype)` builds the inputs; `ours` and `torch` take
    them and return a tensor or a tuple of tensors."""

    op: str
    shape: tuple[int, ...]
    make: Callable[[torch.device, torch.dtype], tuple]
    ours: Callable
    torch: Callable

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))


def _leaf(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tuple(shape), device=device, dtype=dtype).requires_grad_()


def _padding_mask(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of shape (..., 1, N) for an (..., rows, N) input: 0, and -inf on the last
    eighth of the columns (padding), broadcast over the rows as attention broadcasts it."""
    mask = torch.zeros((*shape[:-2], 1, shape[-1]) if len(shape) > 2 else (1, shape[-1]),
                       device=device, dtype=dtype)
    mask[..., -max(1, shape[-1] // 8):] = float("-inf")
    return mask


def _torch_add_norm(rms: bool, p: float = 0.0) -> Callable:
    """torch's (dropout +) add + norm, returning the normalized output and the sum."""
    def fn(x, residual, weight, bias=None):
        total = (F.dropout(x, p) if p else x) + residual
        if rms:
            return F.rms_norm(total, (x.shape[-1],), weight, EPS), total
        return F.layer_norm(total, (x.shape[-1],), weight, bias, EPS), total
    return fn


def _ours_add_norm(rms: bool, p: float = 0.0) -> Callable:
    """The generated (dropout +) add + norm, prenorm: the dropout ops where p > 0."""
    def fn(x, residual, weight, bias=None):
        dropout = {"dropout_p": p} if p else {}
        if rms:
            op = dropout_add_rms_norm if p else add_rms_norm
            return op(x, residual, (x.shape[-1],), weight, EPS, prenorm=True, **dropout)
        op = dropout_add_layer_norm if p else add_layer_norm
        return op(x, residual, (x.shape[-1],), weight, bias, EPS, prenorm=True, **dropout)
    return fn


def _rotary_inputs(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> tuple:
    """q and k of attention over an (..., seq, width) hidden state: heads of ROPE_HEAD_DIM
    columns (the whole width where narrower), a quarter as many key heads (grouped-query), and
    cos and sin of (batch, seq, head_dim), as Hugging Face's rotary embedding gives them."""
    head_dim = min(ROPE_HEAD_DIM, shape[-1])
    heads, seq, batch = shape[-1] // head_dim, shape[-2], math.prod(shape[:-2])
    # (batch, seq, heads, head_dim) projections, which the call sees as (batch, heads, seq,
    # head_dim), as attention does (`_attention_view`)
    q = _leaf((batch, seq, heads, head_dim), device, dtype)
    k = _leaf((batch, seq, max(1, heads // 4), head_dim), device, dtype)
    angles = torch.rand((batch, seq, head_dim // 2), device=device) * 100
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _attention_view(rotary: Callable) -> Callable:
    """`rotary` over the (batch, heads, seq, head_dim) views of q and k, taken in the call: a
    view taken once outside would be a node of autograd's graph made outside a CUDA graph's
    capture, which the captured backward cannot run."""
    return lambda q, k, cos, sin: rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _torch_rotary(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _targets(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    target = torch.randint(0, vocab, (rows,), device=device)
    target[::20] = -100
    return target


def cases(smoke: bool) -> Iterator[Case]:
    """Every op at every shape (see the module docstring)."""
    for shape in SMOKE_SHAPES if smoke else SHAPES:
        n = shape[-1]

        def x_only(device, dtype, shape=shape):
            return (_leaf(shape, device, dtype),)

        def norm(device, dtype, shape=shape, params=2):
            return (_leaf(shape, device, dtype),
                    *(_leaf((shape[-1],), device, dtype) for _ in range(params)))

        def add_norm(device, dtype, shape=shape, params=2):
            return (_leaf(shape, device, dtype), _leaf(shape, device, dtype),
                    *(_leaf((shape[-1],), device, dtype) for _ in range(params)))

        def two(device, dtype, shape=shape):
            return _leaf(shape, device, dtype), _leaf(shape, device, dtype)

        def masked(device, dtype, shape=shape):
            return _leaf(shape, device, dtype), _padding_mask(shape, device, dtype)

        def bda(device, dtype, shape=shape):
            return (_leaf(shape, device, dtype), _leaf(shape, device, dtype),
                    _leaf((shape[-1],), device, dtype))

        yield Case("layer_norm", shape, norm,
                   lambda x, w, b, n=n: layer_norm(x, (n,), w, b),
                   lambda x, w, b, n=n: F.layer_norm(x, (n,), w, b))
        yield Case("rms_norm", shape, lambda d, t, norm=norm: norm(d, t, params=1),
                   lambda x, w, n=n: rms_norm(x, (n,), w, EPS),
                   lambda x, w, n=n: F.rms_norm(x, (n,), w, EPS))
        yield Case("add_layer_norm", shape, add_norm, _ours_add_norm(False),
                   _torch_add_norm(False))
        yield Case("add_rms_norm", shape, lambda d, t, add_norm=add_norm: add_norm(d, t, params=1),
                   _ours_add_norm(True), _torch_add_norm(True))
        yield Case("dropout_add_layer_norm", shape, add_norm, _ours_add_norm(False, DROPOUT),
                   _torch_add_norm(False, DROPOUT))
        yield Case("dropout_add_rms_norm", shape,
                   lambda d, t, add_norm=add_norm: add_norm(d, t, params=1),
                   _ours_add_norm(True, DROPOUT), _torch_add_norm(True, DROPOUT))
        yield Case("softmax", shape, x_only, lambda x: softmax(x, -1),
                   lambda x: torch.softmax(x, -1))
        yield Case("masked_softmax", shape, masked,
                   lambda x, mask: masked_softmax(x, mask, scale=SCALE, dropout_p=DROPOUT),
                   lambda x, mask: F.dropout(torch.softmax(x * SCALE + mask, -1), DROPOUT))
        yield Case("gelu", shape, x_only, gelu, F.gelu)
        yield Case("gelu_tanh", shape, x_only, gelu_tanh,
                   lambda x: F.gelu(x, approximate="tanh"))
        yield Case("swiglu", shape, two, swiglu, lambda gate, up: F.silu(gate) * up)
        yield Case("geglu", shape, two, geglu, lambda gate, up: F.gelu(gate) * up)
        yield Case("geglu_tanh", shape, two, geglu_tanh,
                   lambda gate, up: F.gelu(gate, approximate="tanh") * up)
        yield Case("bias_dropout_add", shape, bda,
                   lambda x, residual, bias: bias_dropout_add(x, residual, bias=bias, p=DROPOUT),
                   lambda x, residual, bias: residual + F.dropout(x + bias, DROPOUT))
        yield Case("apply_rotary_pos_emb", shape,
                   lambda device, dtype, shape=shape: _rotary_inputs(shape, device, dtype),
                   _attention_view(apply_rotary_pos_emb),
                   _attention_view(_torch_rotary))
    for rows, vocab in (SMOKE_CROSS_ENTROPY if smoke
                        else [(rows, VOCAB) for rows in CROSS_ENTROPY_ROWS]):
        def logits(device, dtype, rows=rows, vocab=vocab):
            return _leaf((rows, vocab), device, dtype), _targets(rows, vocab, device)

        yield Case("cross_entropy", (rows, vocab), logits, cross_entropy, F.cross_entropy)


OPS = tuple(dict.fromkeys(case.op for case in cases(smoke=True)))


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def step(fn: Callable, inputs: tuple, mode: str) -> Callable[[], object]:
    """One call of `fn` in `mode`, as a zero-argument function."""
    if mode == "fwd":
        return lambda: fn(*inputs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    upstream = [torch.randn_like(out) if out.dim() else torch.ones_like(out)
                for out in _outputs(fn(*inputs))]
    return lambda: torch.autograd.grad(_outputs(fn(*inputs)), leaves, upstream)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(call: Callable[[], object], calls: int, repeats: int, warmup: int,
            device: torch.device) -> list[float]:
    """Wall-clock µs per call of `calls` back-to-back calls, synced at both ends, after `warmup`
    calls (Triton's JIT, the caching allocator's first blocks); one value per repeat."""
    for _ in range(warmup):
        call()
    values = []
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        values.append((time.perf_counter() - began) * 1e6 / calls)
    return values


def gpu_us(call: Callable[[], object]) -> float:
    """Device µs per call: `GRAPH_CALLS` calls captured in one CUDA graph, replayed between CUDA
    events (no host work on replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end) * 1e3 / (GRAPH_CALLS * GRAPH_REPLAYS)
    del graph
    return elapsed


def _error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def measure_case(case: Case, device: torch.device, dtype: torch.dtype, calls: int,
                 repeats: int, warmup: int) -> list[dict]:
    """One record per mode and provider."""
    torch.manual_seed(0)
    inputs = case.make(device, dtype)
    records = []
    for mode in MODES:
        for provider in PROVIDERS:
            record = {"op": case.op, "shape": case.label, "mode": mode, "provider": provider,
                      "host_us": None, "host_us_repeats": [], "gpu_us": None, "error": None}
            try:
                call = step(getattr(case, provider), inputs, mode)
                record["host_us_repeats"] = host_us(call, calls, repeats, warmup, device)
                record["host_us"] = statistics.median(record["host_us_repeats"])
            except Exception as error:  # noqa: BLE001 - a failing call is recorded, the run goes on
                record["error"] = _error(error)
            if device.type == "cuda" and record["error"] is None:
                try:
                    record["gpu_us"] = gpu_us(call)
                except Exception as error:  # noqa: BLE001 - recorded as the GPU column's error
                    record["error"] = f"CUDA graph: {_error(error)}"
                torch.cuda.empty_cache()
            records.append(record)
    return records


def bound(record: dict) -> str:
    if record["host_us"] is None or record["gpu_us"] is None:
        return "—"
    return "host" if record["host_us"] > HOST_BOUND * record["gpu_us"] else "GPU"


def _number(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def tables(records: list[dict]) -> str:
    """One markdown table per mode: op, shape, host µs of each provider, their ratio, GPU µs of
    each and which bounds each call."""
    cells = {(r["op"], r["shape"], r["mode"], r["provider"]): r for r in records}
    rows = list(dict.fromkeys((r["op"], r["shape"]) for r in records))
    out = []
    for mode in MODES:
        if not any(r["mode"] == mode for r in records):
            continue
        out += [f"{'Forward' if mode == 'fwd' else 'Forward + backward'} ({mode}), µs per call:",
                "",
                "| op | shape | ours µs | torch µs | ours ÷ torch | ours GPU µs | torch GPU µs "
                "| ours bound | torch bound |",
                "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for op, shape in rows:
            ours, theirs = (cells.get((op, shape, mode, p)) for p in PROVIDERS)
            if ours is None or theirs is None:
                continue
            ratio = (ours["host_us"] / theirs["host_us"]
                     if ours["host_us"] and theirs["host_us"] else None)
            out.append(f"| {op} | {shape} | {_number(ours['host_us'])} | "
                       f"{_number(theirs['host_us'])} | "
                       f"{'—' if ratio is None else f'{ratio:.2f}'} | "
                       f"{_number(ours['gpu_us'])} | {_number(theirs['gpu_us'])} | "
                       f"{bound(ours)} | {bound(theirs)} |")
        out.append("")
        failed = [r for r in records if r["mode"] == mode and r["error"]]
        out += [f"- {r['op']} {r['shape']} {mode} {r['provider']}: {r['error']}" for r in failed]
        out += [""] if failed else []
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="", help=f"comma-separated, of {', '.join(OPS)}")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--calls", type=int, help="back-to-back calls per repeat (200)")
    parser.add_argument("--repeats", type=int, help="repeats; the median is reported (5)")
    parser.add_argument("--out", type=Path, help="write the records as JSON")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on the CPU, fp32: tests the harness")
    args = parser.parse_args(argv)
    chosen = names(parser, "--ops", args.ops, OPS)
    env, dtype = user_level_setup(args.cpu_smoke, args.dtype)
    calls = args.calls or (3 if args.cpu_smoke else 200)
    repeats = args.repeats or (2 if args.cpu_smoke else 5)
    warmup = 1 if args.cpu_smoke else max(3, calls // 10)
    records = []
    for case in cases(args.cpu_smoke):
        if chosen and case.op not in chosen:
            continue
        records += measure_case(case, env.device, dtype, calls, repeats, warmup)
        print(f"{case.op} {case.label}", file=sys.stderr, flush=True)
    meta = {**env.info, "dtype": str(dtype).removeprefix("torch."), "calls": calls,
            "repeats": repeats, "warmup": warmup, "graph_calls": GRAPH_CALLS,
            "graph_replays": GRAPH_REPLAYS,
            "command": shlex.join(["python", "-m", "benchmarks.host",
                                   *(sys.argv[1:] if argv is None else argv)])}
    print(f"# Host µs per call: {meta['device_name']}, torch {meta['torch']}, {meta['dtype']}, "
          f"{calls} calls x {repeats} repeats\n")
    print(tables(records))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
