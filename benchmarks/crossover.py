"""Where a generated op's forward+backward starts to cost less than torch's expression of it,
and which of the two wins under torch.compile: the measurements `codegen/runtime/dispatch.py`
decides by.

    python -m benchmarks.crossover [--cols 768,2048,4096] [--rows 128,512,2048,8192,32768]
    python -m benchmarks.crossover --write      # also store the choices in the schedule table
    python -m benchmarks.crossover --compile --rows 8192 --cols 2048 --write
                                                # both under torch.compile instead
    python -m benchmarks.crossover --from A.json B.json --write   # choose from saved rows
    python -m benchmarks.crossover --routes [--vocab 32000,128256] --write
                                                # patch_model's loss route against the
                                                # model's own loss (`own_below`)
    python -m benchmarks.crossover --inference --write
                                                # the forward alone under torch.no_grad
                                                # (`infer_below`)
    python -m benchmarks.crossover --cpu-smoke  # tiny sizes on the CPU: tests the harness

Each op is timed where a transformer block calls it: after the matrix multiplications a block
does per row op (a block of width N multiplies by 12 N^2 weights and calls about four row ops:
a rows x 3N input times a 3N x N weight), forward and backward of both, bf16, back-to-back
steps with a sync at both ends, the generated kernels and torch's expression (the spec's
`reference`, the same one the dispatch runs) in the same run. The multiplication's GPU time
hides host time, as the rest of a model's step does; an op alone back to back would be bound
by host time up to tens of millions of elements. Since the multiplication's time grows as rows x
cols^2, that is what `eager_below` of an op counts: where its kernels measured faster from
(`choose`). `compiled` is the faster of the two compiled, at the largest size measured.

`--routes` measures the routes of `patch_model` that replace a stretch of a model's own code
with generated ops that have no torch expression: the loss from the hidden states
(`linear_cross_entropy` of the hidden states and the output layer's weight, against that
layer's logits in whole, upcast to float32, then torch's cross-entropy: transformers'
causal-LM loss). Both include the output layer's multiply, whose work (rows x hidden x
vocabulary) is what the route's `own_below` counts, and the peak memory of each is measured:
the route is chosen from the smallest size on which it is faster, as above, and no larger.
(The fused residual add + norm of a layer follows its op's `eager_below`: below it the op
runs torch's expression, the layer's own computation.)

`--inference` times the same block's forward alone under `torch.no_grad` (generation,
evaluation): a call then pays the forward's host time only, so the kernels can win from a
smaller size. Its choice is `infer_below`, which the dispatch uses wherever autograd records
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

#: an op's kernels must be at least this much faster to be chosen (ours / torch below it)
MARGIN = 0.98
#: the inner dimension of the multiplication before the op, in units of its width: a
#: transformer block's 12 N^2 weights over its four row ops
GEMM_WIDTHS = 3


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


def ops() -> dict:
    """op name -> (generated module, call(h, other, weight, bias) -> output)."""
    from generated import (
        add_layernorm,
        add_rmsnorm,
        bias_dropout_add,
        dropout_add_layernorm,
        dropout_add_rmsnorm,
        geglu,
        gelu,
        gelu_tanh,
        layernorm,
        rmsnorm,
        softmax,
        swiglu,
    )

    def width(h):
        return (h.shape[-1],)

    return {
        "layernorm": (layernorm, lambda h, o, w, b: layernorm.layer_norm(h, width(h), w, b)),
        "rmsnorm": (rmsnorm, lambda h, o, w, b: rmsnorm.rms_norm(h, width(h), w, 1e-6)),
        "add_layernorm": (add_layernorm,
                          lambda h, o, w, b: add_layernorm.add_layer_norm(h, o, width(h), w, b)),
        "add_rmsnorm": (add_rmsnorm,
                        lambda h, o, w, b: add_rmsnorm.add_rms_norm(h, o, width(h), w, 1e-6)),
        "softmax": (softmax, lambda h, o, w, b: softmax.softmax(h, -1)),
        "gelu": (gelu, lambda h, o, w, b: gelu.gelu(h, bias=b)),
        "gelu_tanh": (gelu_tanh, lambda h, o, w, b: gelu_tanh.gelu_tanh(h, bias=b)),
        "swiglu": (swiglu, lambda h, o, w, b: swiglu.swiglu(h, o)),
        "geglu": (geglu, lambda h, o, w, b: geglu.geglu(h, o)),
        "bias_dropout_add": (bias_dropout_add, lambda h, o, w, b: bias_dropout_add
                             .bias_dropout_add(h, o, bias=b, training=False)),
        # BERT's sublayer outputs: dropout on (no seed: torch's expression draws its own mask)
        "dropout_add_layernorm": (dropout_add_layernorm, lambda h, o, w, b: dropout_add_layernorm
                                  .dropout_add_layer_norm(h, o, width(h), w, b, dropout_p=0.1)),
        "dropout_add_rmsnorm": (dropout_add_rmsnorm, lambda h, o, w, b: dropout_add_rmsnorm
                                .dropout_add_rms_norm(h, o, width(h), w, 1e-6, dropout_p=0.1)),
    }


def step(module, call, M: int, N: int, device: str, dtype: torch.dtype, compiled: bool,
         inference: bool = False):
    """One forward+backward of `(M, 3N) @ (3N, N) -> op` on (M, N) rows, or with `inference`
    its forward alone under torch.no_grad, as a function of the dispatch mode ("kernels" or
    "torch")."""
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_()

    x, other = leaf(M, GEMM_WIDTHS * N), leaf(M, N)
    linear = leaf(GEMM_WIDTHS * N, N, scale=(GEMM_WIDTHS * N) ** -0.5)
    w, b = leaf(N), leaf(N)
    g = torch.randn(M, N, device=device, dtype=dtype)

    def block(x, other, linear, w, b):
        return call(x @ linear, other, w, b)

    fn = torch.compile(block) if compiled else block

    def run(mode):
        def once():
            with (module.DISPATCH.override(compiled=mode) if compiled
                  else module.DISPATCH.override(mode)):
                if inference:
                    with torch.no_grad():
                        fn(x, other, linear, w, b)
                else:
                    fn(x, other, linear, w, b).backward(g)
        return once
    return run


def routes() -> dict:
    """route op -> (generated module, ours(h, w, labels), own(h, w, labels)): the loss."""
    import torch.nn.functional as F

    from generated import cross_entropy

    def ours(h, w, labels):
        return cross_entropy.linear_cross_entropy(h, w, labels, out_dtype=torch.float32)

    def own(h, w, labels):
        return F.cross_entropy(F.linear(h, w).float(), labels)

    return {"cross_entropy": (cross_entropy, ours, own)}


def route_step(call, M: int, H: int, V: int, device: str, dtype: torch.dtype):
    """One forward+backward of a loss over M rows of width H and V classes."""
    h = (torch.randn(M, H, device=device, dtype=dtype)).requires_grad_()
    w = (torch.randn(V, H, device=device, dtype=dtype) * H ** -0.5).requires_grad_()
    labels = torch.randint(0, V, (M,), device=device)

    def once():
        call(h, w, labels).backward()
    return once


def peak_bytes(fn, device: str) -> int:
    """The peak memory one call of `fn` allocates beyond what was allocated before it (0 on
    the CPU, which does not count)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def work(row: dict) -> tuple[int, int]:
    """What the dispatch compares with `eager_below`: rows x cols^2 (the block's multiply work,
    whose GPU time hides a call's host time), then the elements; for a route's row, what it
    compares with `own_below`: rows x cols x vocabulary (the output layer's multiply)."""
    if "vocab" in row:
        return row["rows"] * row["cols"] * row["vocab"], row["rows"] * row["cols"]
    return row["rows"] * row["cols"] ** 2, row["rows"] * row["cols"]


def _winning_from(measured: list[dict], ratios: list[float], fits: list[bool]) -> int:
    """The smallest `work` of the rows (sorted by it) from which ours is faster by `MARGIN` in
    geometric mean over every larger one, faster there and no larger in memory from there on;
    past the largest where there is none."""
    for index, row in enumerate(measured):
        if ratios[index] < 1 and statistics.geometric_mean(ratios[index:]) < MARGIN \
                and all(fits[index:]):
            return work(row)[0]
    return work(measured[-1])[0] + 1


def choose(rows: list[dict]) -> dict[str, dict]:
    """The table's "dispatch" entries from measured rows: per op, `eager_below` (elements),
    where measured `compiled`, for a route's rows `own_below`, and for forward-only rows
    (`--inference`) `infer_below`.

    `eager_below` is the smallest measured `work` at which the kernels were faster and from
    which on they were faster by `MARGIN` in geometric mean over every larger one (one noisy
    cell near parity neither hides a crossover nor makes one); past every size measured where
    there is none (torch's expression always)."""
    table = {}
    for op in sorted({row["op"] for row in rows}):
        own = sorted((r for r in rows if r["op"] == op and "torch_us" in r), key=work)
        entry = {}
        if own:
            entry["eager_below"] = _winning_from(
                own, [r["ours_us"] / r["torch_us"] for r in own], [True] * len(own))
        forward = sorted((r for r in rows if r["op"] == op and "infer_torch_us" in r),
                         key=work)
        if forward:
            entry["infer_below"] = _winning_from(
                forward, [r["infer_ours_us"] / r["infer_torch_us"] for r in forward],
                [True] * len(forward))
        route = sorted((r for r in rows if r["op"] == op and "own_us" in r), key=work)
        if route:
            entry["own_below"] = _winning_from(
                route, [r["ours_us"] / r["own_us"] for r in route],
                [r["ours_peak"] <= r["own_peak"] for r in route])
        compiled = [r for r in rows if r["op"] == op and "compiled_ours_us" in r]
        if compiled:
            largest = max(compiled, key=lambda r: r["rows"] * r["cols"])
            faster = largest["compiled_ours_us"] < MARGIN * largest["compiled_torch_us"]
            entry["compiled"] = "kernels" if faster else "torch"
        table[op] = entry
    return table


def write_table(choices: dict[str, dict]) -> None:
    from codegen.schedule import load_measured, write_measured

    table = load_measured()
    dispatch = table.setdefault("dispatch", {})
    for op, entry in choices.items():
        dispatch[op] = {**dispatch.get(op, {}), **entry}
    table["dispatch"] = dict(sorted(table["dispatch"].items()))
    write_measured(table)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cols", default="768,2048,4096")
    parser.add_argument("--rows", default="128,512,2048,8192,32768")
    parser.add_argument("--ops", help="comma-separated op names (default: every op)")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true",
                        help="time both under torch.compile instead, at the largest rows "
                             "(compiles take tens of seconds each: give one size)")
    parser.add_argument("--write", action="store_true",
                        help="store the choices in codegen/schedule_table.json")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--routes", action="store_true",
                        help="measure patch_model's loss route instead (rows x --cols hidden "
                             "x --vocab classes)")
    parser.add_argument("--vocab", default="32000,128256")
    parser.add_argument("--inference", action="store_true",
                        help="time the forward alone under torch.no_grad (`infer_below`)")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--from", dest="saved", nargs="+", metavar="FILE",
                        help="choose from rows saved by --out instead of measuring")
    args = parser.parse_args(argv)
    if args.saved:
        results = [row for path in args.saved for row in json.loads(Path(path).read_text())]
        choices = choose(results)
        print(json.dumps(choices, indent=1))
        if args.write:
            write_table(choices)
        return results
    if args.cpu_smoke:
        device, dtype, sync = "cpu", torch.float32, lambda: None
        cols, rows, calls, repeats, vocabs = (64,), (4, 16), 2, 1, (256,)
    else:
        device, dtype, sync = "cuda", torch.bfloat16, torch.cuda.synchronize
        cols = tuple(int(c) for c in args.cols.split(","))
        rows = tuple(int(r) for r in args.rows.split(","))
        calls, repeats = args.calls, args.repeats
        vocabs = tuple(int(v) for v in args.vocab.split(","))
    if args.routes:
        results = measure_routes(rows, cols, vocabs, device, dtype, calls, repeats, sync)
        return finish(results, args)
    chosen = ops()
    if args.ops:
        chosen = {name: chosen[name] for name in args.ops.split(",")}
    results = []
    # forward-only rows keep their own fields: a run's rows for --inference and without it
    # choose `infer_below` and `eager_below` apart, from one saved file or several
    prefix = "infer_" if args.inference else ""
    if not args.compile:
        print(f"| op{' (forward)' if args.inference else ''} | rows x cols | ours µs | "
              "torch µs | ours / torch |")
        print("|---|---|---|---|---|")
    for N in cols if not args.compile else ():
        for M in rows:
            for name, (module, call) in chosen.items():
                run = step(module, call, M, N, device, dtype, compiled=False,
                           inference=args.inference)
                mine = wall_micros(run("kernels"), calls, repeats, sync)
                theirs = wall_micros(run("torch"), calls, repeats, sync)
                results.append({"op": name, "rows": M, "cols": N, f"{prefix}ours_us": mine,
                                f"{prefix}torch_us": theirs})
                print(f"| {name} | {M}x{N} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} |",
                      flush=True)
    if args.compile:
        print("| op (compiled) | rows x cols | ours µs | torch µs | ours / torch |")
        print("|---|---|---|---|---|")
        M = rows[-1]
        for N in cols:
            for name, (module, call) in chosen.items():
                torch._dynamo.reset()
                run = step(module, call, M, N, device, dtype, compiled=True)
                mine = wall_micros(run("kernels"), calls, repeats, sync)
                torch._dynamo.reset()
                theirs = wall_micros(run("torch"), calls, repeats, sync)
                results.append({"op": name, "rows": M, "cols": N, "compiled_ours_us": mine,
                                "compiled_torch_us": theirs})
                print(f"| {name} | {M}x{N} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} |",
                      flush=True)
    return finish(results, args)


def measure_routes(rows, cols, vocabs, device, dtype, calls, repeats, sync) -> list[dict]:
    """Each route against the model's own code at every rows x hidden x vocabulary."""
    results = []
    print("| route | rows x hidden x vocab | ours µs | own µs | ours / own | ours MiB | own MiB |")
    print("|---|---|---|---|---|---|---|")
    for V in vocabs:
        for H in cols:
            for M in rows:
                for name, (_, ours, own) in routes().items():
                    mine, theirs = (route_step(f, M, H, V, device, dtype) for f in (ours, own))
                    row = {"op": name, "rows": M, "cols": H, "vocab": V,
                           "ours_us": wall_micros(mine, calls, repeats, sync),
                           "own_us": wall_micros(theirs, calls, repeats, sync),
                           "ours_peak": peak_bytes(mine, device),
                           "own_peak": peak_bytes(theirs, device)}
                    results.append(row)
                    print(f"| {name} | {M}x{H}x{V} | {row['ours_us']:.1f} | "
                          f"{row['own_us']:.1f} | {row['ours_us'] / row['own_us']:.2f} | "
                          f"{row['ours_peak'] / 2**20:.0f} | {row['own_peak'] / 2**20:.0f} |",
                          flush=True)
    return results


def finish(results: list[dict], args) -> list[dict]:
    """Print the choices, store them with --write, save the rows with --out."""
    choices = choose(results)
    print("\n" + json.dumps(choices, indent=1))
    if args.write:
        write_table(choices)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)
    return results


if __name__ == "__main__":
    main()
