"""Activation memory of the generated transformer layers, per DeepSpeed memory option, against
the plain-PyTorch reference layer (tests/layer_reference.py) of the same structure.

    python -m benchmarks.layers_memory                 # GPU: BERT-large size, bf16
    python -m benchmarks.layers_memory --cpu           # anywhere: small sizes, fp32, saved bytes
    python -m benchmarks.layers_memory --layers 4 --batch 8 --seq 512 --hidden 1024 --heads 16

A stack of `--layers` layers in training mode with DeepSpeed's default dropout (0.1 on the
attention probabilities and on the hidden states). Per configuration:

- saved: the bytes of every tensor autograd keeps for the backward, collected with
  torch.autograd.graph.saved_tensors_hooks during the forward; a storage shared by several saved
  tensors (views) counts once; parameters and the stack's input are not counted. A checkpointed
  region counts what torch.utils.checkpoint keeps: its inputs.
- peak (CUDA only): torch.cuda.max_memory_allocated during the forward minus what was allocated
  before it: the activations plus the forward's transient buffers.
- step (CUDA only): median time of a forward + backward, CUDA events, in ms.

Prints a markdown table; "x ref" is the ratio to the reference layer of the same group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from layer_reference import ReferenceLayer  # noqa: E402

from generated.bert_layer import BertLayer  # noqa: E402
from generated.gpt_layer import GPTLayer  # noqa: E402

DROPOUT = 0.1
MIB = 2**20
REFERENCE = "reference (torch ops)"

#: (group, label, layer class, options); a group's first row is the reference layer holding the
#: parameters of a generated one built with those options (the same structure: pre/post-LN,
#: causal), in plain torch ops
CHECKPOINTS = {"gelu_checkpoint": True, "attn_dropout_checkpoint": True,
               "normalize_invertible": True}
ROWS = [
    ("BERT post-LN", REFERENCE, BertLayer, {}),
    ("BERT post-LN", "default", BertLayer, {}),
    ("BERT post-LN", "gelu_checkpoint", BertLayer, {"gelu_checkpoint": True}),
    ("BERT post-LN", "attn_dropout_checkpoint", BertLayer, {"attn_dropout_checkpoint": True}),
    ("BERT post-LN", "normalize_invertible", BertLayer, {"normalize_invertible": True}),
    ("BERT post-LN", "all three", BertLayer, CHECKPOINTS),
    ("BERT post-LN", 'attention="sdpa"', BertLayer, {"attention": "sdpa"}),
    ("BERT pre-LN", REFERENCE, BertLayer, {"pre_layer_norm": True}),
    ("BERT pre-LN", "default", BertLayer, {"pre_layer_norm": True}),
    ("BERT pre-LN", "all three", BertLayer, {"pre_layer_norm": True, **CHECKPOINTS}),
    ("GPT", REFERENCE, GPTLayer, {}),
    ("GPT", 'attention="materialized"', GPTLayer, {"attention": "materialized"}),
    ("GPT", "materialized, all three", GPTLayer, {"attention": "materialized", **CHECKPOINTS}),
    ("GPT", 'default (attention="sdpa")', GPTLayer, {}),
    ("GPT", "sdpa, gelu_checkpoint + normalize_invertible", GPTLayer,
     {"gelu_checkpoint": True, "normalize_invertible": True}),
]


@dataclass
class Size:
    layers: int
    batch: int
    seq: int
    hidden: int
    heads: int

    @property
    def intermediate(self) -> int:
        return 4 * self.hidden


def build(cls: type, options: dict, reference: bool, size: Size, device: str,
          dtype: torch.dtype) -> list[torch.nn.Module]:
    """The stack of generated layers, or of reference layers holding their parameters."""
    torch.manual_seed(0)
    layers = [cls(size.hidden, size.heads, size.intermediate, DROPOUT, DROPOUT, device=device,
                  dtype=dtype, **options) for _ in range(size.layers)]
    if reference:
        layers = [ReferenceLayer.like(layer) for layer in layers]
    return [layer.train() for layer in layers]


def run(layers: list[torch.nn.Module], x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x, mask)
    return x


def saved_bytes(layers: list[torch.nn.Module], x: torch.Tensor, mask: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves during one forward (see the module doc)."""
    excluded = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    excluded.add(x.untyped_storage().data_ptr())
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run(layers, x, mask)
    out.float().sum().backward()
    return sum(storages.values())


def peak_bytes(layers: list[torch.nn.Module], x: torch.Tensor, mask: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = run(layers, x, mask)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    out.float().sum().backward()
    return peak


def step_ms(layers: list[torch.nn.Module], x: torch.Tensor, mask: torch.Tensor,
            repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(layers, x, mask).float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(size: Size, device: str, dtype: torch.dtype, repeats: int,
            progress: Callable[[str], None]) -> list[dict]:
    x = torch.randn(size.batch, size.seq, size.hidden, device=device, dtype=dtype)
    mask = torch.zeros(size.batch, 1, 1, size.seq, device=device, dtype=dtype)
    mask[0, ..., size.seq // 2:] = -10000.0  # padding in the first sequence
    results = []
    for group, label, cls, options in ROWS:
        layers = build(cls, options, label == REFERENCE, size, device, dtype)
        row = {"group": group, "label": label, "saved": saved_bytes(layers, x, mask)}
        if device == "cuda":
            run(layers, x, mask).float().sum().backward()  # warm-up (Triton JIT)
            row["peak"] = peak_bytes(layers, x, mask)
            row["ms"] = step_ms(layers, x, mask, repeats)
        results.append(row)
        progress(f"{group}: {label}: saved {row['saved'] / MIB:.1f} MiB")
        del layers
    return results


def table(results: list[dict], cuda: bool) -> str:
    header = "| layer | option | saved MiB | x ref |"
    rule = "|---|---|---:|---:|"
    if cuda:
        header += " peak fwd MiB | x ref | fwd+bwd ms |"
        rule += "---:|---:|---:|"
    lines = [header, rule]
    reference: dict[str, dict] = {}
    for row in results:
        base = reference.setdefault(row["group"], row)
        line = (f"| {row['group']} | {row['label']} | {row['saved'] / MIB:.1f} | "
                f"{row['saved'] / base['saved']:.2f} |")
        if cuda:
            line += (f" {row['peak'] / MIB:.1f} | {row['peak'] / base['peak']:.2f} | "
                     f"{row['ms']:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU (saved bytes only; small default sizes, fp32)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (CUDA)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        os.environ.pop("TRITON_INTERPRET", None)  # the generated torch path: same saved tensors
    default = Size(4, 8, 512, 1024, 16) if cuda else Size(2, 2, 64, 64, 4)
    size = Size(*(getattr(args, f) or getattr(default, f)
                  for f in ("layers", "batch", "seq", "hidden", "heads")))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if cuda else "fp32")]
    device = "cuda" if cuda else "cpu"
    where = torch.cuda.get_device_name() if cuda else "CPU"
    results = measure(size, device, dtype, args.repeats,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{size.layers} layers, batch {size.batch}, seq {size.seq}, hidden {size.hidden}, "
          f"heads {size.heads}, intermediate {size.intermediate}, {dtype}, dropout {DROPOUT}, "
          f"training; {where}, torch {torch.__version__}\n")
    print(table(results, cuda))
    return 0


if __name__ == "__main__":
    sys.exit(main())
