"""Every generated kernel compiled for an NVIDIA GPU on a machine without one: the kernels the
launchers call, with the arguments and constexprs they pass, through Triton's own compiler
down to a cubin (ptxas ships with Triton's NVIDIA backend). Triton's interpreter runs the
kernels' Python; only the compiler checks what it lowers (types of loop-carried values,
shapes of reductions, constexpr branches), so a kernel the interpreter runs may still not
compile.

    python tests/kernel_compile.py capture FILE    # TRITON_INTERPRET=1: record the launches
    python tests/kernel_compile.py compile FILE    # compile each recorded launch, report

`capture` runs every op of `benchmarks.host` (forward and backward, fp32 and bf16, on small
shapes), the norms' other memory modes and `linear_cross_entropy`, under each kernel form the
schedules pick (rows whole, looped in one sweep, looped in a pass each, every other sweep
backwards, split), and records each distinct launch: the kernel, the type of every argument,
the value of every constexpr and the launch options. The launchers choose as on a GPU but
where the interpreter, which runs its programs one after another, is given other sizes: the
column sums' blocks, which `compile` takes as CUDA's (`_on_cuda`), and a split row's slab
width. `compile` compiles each for `TARGET` and prints the resource use of each, or the
compiler's error; it exits 1 if any failed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
import traceback

TARGET = ("cuda", 90, 32)  # an H100


def _on_cuda(kernel: str) -> dict:
    """Constexprs a CUDA launch gives where the interpreter's launch, whose programs run one
    after another, takes others: the column sums' blocks."""
    from codegen.runtime import launch

    if kernel == "column_sums_kernel":
        return {"BLOCK_C": launch.COLUMN_SUM_BLOCK_C, "BLOCK_P": launch.COLUMN_SUM_BLOCK_P}
    return {}

_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
          "int64": "i64", "int32": "i32", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _describe(value, constexpr: bool):
    """An argument as JSON: a constexpr's value (a dtype as its name), else its type."""
    import torch
    import triton.language as tl

    if constexpr:
        if isinstance(value, tl.dtype):
            return {"dtype": str(value)}
        return {"value": value}
    if value is None:
        return {"value": None}
    if isinstance(value, torch.Tensor):
        return {"type": "*" + _TYPES[str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, bool):
        return {"type": "i1"}
    if isinstance(value, int):
        return {"type": "i64" if not -2**31 <= value < 2**31 else "i32"}
    if isinstance(value, float):
        return {"type": "fp32"}
    raise TypeError(f"an argument of type {type(value).__name__}")


def capture(path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(__file__))
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    from reference import force_looped, force_split

    from benchmarks import host
    from codegen.runtime import dispatch

    dispatch.FORCED = "kernels"
    records: dict[str, dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        parameters = inspect.signature(self.fn).parameters
        # positionally or by name; a parameter not passed takes its default
        bound = {name: p.default for name, p in parameters.items()
                 if p.default is not inspect.Parameter.empty}
        bound |= dict(zip(parameters, args, strict=False))
        bound |= {k: v for k, v in kwargs.items() if k in parameters}
        arguments = [[name, _describe(bound.get(name),
                                      parameter.annotation is tl.constexpr
                                      or parameter.annotation == "tl.constexpr")]
                     for name, parameter in parameters.items()]
        options = {k: v for k, v in kwargs.items() if k not in parameters and v is not None}
        record = {"module": self.fn.__module__, "kernel": self.fn.__name__,
                  "arguments": arguments, "options": options}
        records.setdefault(json.dumps(record, sort_keys=True), record)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording
    modules = [importlib.import_module(f"generated.{name}") for name in _ops()]

    def forms():
        yield "whole", contextlib.nullcontext
        for one_sweep, reverse in ((True, False), (False, False), (True, True)):
            yield (f"looped one_sweep={one_sweep} reverse={reverse}",
                   lambda one_sweep=one_sweep, reverse=reverse: _all(
                       force_looped(m, one_sweep, reverse) for m in modules))
        yield "split", lambda: _all(force_split(m) for m in modules
                                    if any(n.endswith("_split") for n in vars(m)))

    for _, form in forms():
        for dtype in (torch.float32, torch.bfloat16):
            for case in host.cases(smoke=True):
                with form():
                    _step(case.ours(*case.make(torch.device("cpu"), dtype)))
            with form():
                for step in _more_steps(dtype):
                    _step(step())
    with open(path, "w") as file:
        json.dump(sorted(records.values(), key=lambda r: json.dumps(r, sort_keys=True)),
                  file, indent=0)
    print(f"{len(records)} launches recorded")


def _ops() -> list[str]:
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "generated"
    return sorted(p.stem for p in folder.glob("*.py")
                  if p.stem not in ("__init__", "patch") and not p.stem.endswith("_layer"))


@contextlib.contextmanager
def _all(managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _step(outputs) -> None:
    import torch

    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    floating = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if floating:
        sum(o.float().sum() for o in floating).backward()


def _more_steps(dtype):
    """What `benchmarks.host` does not call: the norms' other memory modes, and the loss of a
    linear layer (its kernels over windows of the classes)."""
    import torch

    from generated import (
        add_layernorm,
        add_rmsnorm,
        cross_entropy,
        dropout_add_layernorm,
        dropout_add_rmsnorm,
        layernorm,
        rmsnorm,
    )

    def leaf(*shape):
        return torch.randn(shape, dtype=dtype).requires_grad_()

    for module, call in (
            (layernorm, lambda m: layernorm.layer_norm(leaf(4, 64), (64,), leaf(64), leaf(64),
                                                       memory=m)),
            (rmsnorm, lambda m: rmsnorm.rms_norm(leaf(4, 64), (64,), leaf(64), memory=m)),
            (add_layernorm, lambda m: add_layernorm.add_layer_norm(
                leaf(4, 64), leaf(4, 64), (64,), leaf(64), leaf(64), memory=m)),
            (add_rmsnorm, lambda m: add_rmsnorm.add_rms_norm(
                leaf(4, 64), leaf(4, 64), (64,), leaf(64), memory=m)),
            (dropout_add_layernorm, lambda m: dropout_add_layernorm.dropout_add_layer_norm(
                leaf(4, 64), leaf(4, 64), (64,), leaf(64), leaf(64), dropout_p=0.1, memory=m)),
            (dropout_add_rmsnorm, lambda m: dropout_add_rmsnorm.dropout_add_rms_norm(
                leaf(4, 64), leaf(4, 64), (64,), leaf(64), dropout_p=0.1, memory=m))):
        for mode in module._MODES[1:]:
            yield lambda call=call, mode=mode: call(mode)
    target = torch.randint(0, 256, (8,))
    for reduction in ("mean", "none"):
        yield lambda reduction=reduction: cross_entropy.linear_cross_entropy(
            leaf(8, 32), leaf(256, 32), target, reduction=reduction, label_smoothing=0.1,
            chunk_size=4)


def compile_all(path: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with open(path) as file:
        records = json.load(file)
    target = GPUTarget(*TARGET)
    failed = 0
    for record in records:
        kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
        signature, constexprs = {}, {}
        cuda = _on_cuda(record["kernel"])
        for index, (name, described) in enumerate(record["arguments"]):
            if "type" in described:
                signature[name] = described["type"]
                continue
            signature[name] = "constexpr"
            value = cuda.get(name, described.get("value"))
            if "dtype" in described:
                value = triton.language.dtype(described["dtype"])
            constexprs[(index,)] = value
        label = f"{record['module']}.{record['kernel']} {record['options']}"
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature,
                                                constexprs=constexprs),
                                      target=target, options=record["options"])
            print(f"ok     {label} {_usage(compiled)}")
        except Exception:  # noqa: BLE001 - every compiler error is reported, then counted
            failed += 1
            print(f"FAILED {label}\n{traceback.format_exc(limit=3)}")
    print(f"{len(records) - failed} of {len(records)} launches compiled for {TARGET}")
    return 1 if failed else 0


def _usage(compiled) -> str:
    """A compiled kernel's registers, local memory (spills) and shared memory, as
    cuobjdump reads them from its cubin ("" where Triton ships no cuobjdump)."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "--dump-resource-usage", cubin.name],
                                capture_output=True, text=True).stdout
    fields = next((line.split() for line in report.splitlines() if "REG:" in line), [])
    return " ".join(f for f in fields if f.split(":")[0] in ("REG", "LOCAL", "SHARED"))


if __name__ == "__main__":
    command, path = sys.argv[1:3]
    if command == "capture":
        capture(path)
    else:
        sys.exit(compile_all(path))
