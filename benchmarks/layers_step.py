"""Training step of the generated transformer layers against Hugging Face's, same weights, and
what each DeepSpeed memory option costs in time for the memory it saves.

    python -m benchmarks.layers_step [--sizes large,small] [--repeats 20] [--out FILE.json]
                                     [--cpu-smoke]

One layer in training mode, dropout 0.1 on the attention probabilities and on the hidden
states, bf16, input requiring grad (a layer inside a model), per size:

- large: batch 8 x seq 512, hidden 1024, 16 heads, intermediate 4096;
- small: batch 1 x seq 128, hidden 1024, 16 heads, intermediate 4096.

Rows: transformers' `BertLayer` and `GPT2Block` (attn_implementation="sdpa"; GELU and tanh
GELU "gelu_new") holding the weights of the generated `BertLayer` / `GPTLayer` built from the
same seed; the generated layers with attention="sdpa" and "materialized", and with each
DeepSpeed memory option (`gelu_checkpoint`, `attn_dropout_checkpoint` (materialized only),
`normalize_invertible`, all of them). BERT gets an additive (batch, 1, 1, seq) padding mask
(half the first sequence masked), GPT none (causal).

Per row:
- step ms: forward + backward, CUDA events, median of `--repeats` steps after warm-up;
- saved: bytes of the distinct storages autograd keeps for the backward
  (`saved_tensors_hooks`; parameters and the input excluded);
- peak fwd (CUDA): `max_memory_allocated` during the forward minus what was allocated before;
- option cost / saves: against the same generated layer without options (same attention);
- max err vs HF: in eval mode (no dropout), max |ours - HF| / max |HF| of the output: the check
  that both hold the same weights and compute the same layer.

Prints a markdown table per size and writes every record to `--out` as JSON. `--cpu-smoke` runs
a tiny size on the CPU in fp32 (wall clock, no peak; the times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers.models.bert.modeling_bert import BertLayer as HFBertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from benchmarks.environment import DTYPES, names, user_level_setup
from generated.bert_layer import BertLayer
from generated.gpt_layer import GPTLayer

DROPOUT = 0.1
MIB = 2**20
WARMUP = 3


@dataclass(frozen=True)
class Size:
    batch: int
    seq: int
    hidden: int
    heads: int

    @property
    def intermediate(self) -> int:
        return 4 * self.hidden


SIZES = {"large": Size(8, 512, 1024, 16), "small": Size(1, 128, 1024, 16)}
SMOKE_SIZE = Size(2, 16, 64, 4)

ALL_THREE = {"gelu_checkpoint": True, "attn_dropout_checkpoint": True,
             "normalize_invertible": True}
SDPA_OPTIONS = {"gelu_checkpoint": True, "normalize_invertible": True}
#: (group, label, layer: "hf" or the generated class, options); an option row's base is the
#: generated row of its group with the same attention and no option
ROWS = [
    ("BERT", "HF BertLayer (sdpa)", "hf", {}),
    ("BERT", 'ours, attention="sdpa"', BertLayer, {"attention": "sdpa"}),
    ("BERT", "ours, sdpa, gelu_checkpoint + normalize_invertible", BertLayer,
     {"attention": "sdpa", **SDPA_OPTIONS}),
    ("BERT", 'ours, attention="materialized"', BertLayer, {"attention": "materialized"}),
    ("BERT", "ours, materialized, gelu_checkpoint", BertLayer,
     {"attention": "materialized", "gelu_checkpoint": True}),
    ("BERT", "ours, materialized, attn_dropout_checkpoint", BertLayer,
     {"attention": "materialized", "attn_dropout_checkpoint": True}),
    ("BERT", "ours, materialized, normalize_invertible", BertLayer,
     {"attention": "materialized", "normalize_invertible": True}),
    ("BERT", "ours, materialized, all three", BertLayer,
     {"attention": "materialized", **ALL_THREE}),
    ("GPT", "HF GPT2Block (sdpa)", "hf", {}),
    ("GPT", 'ours, attention="sdpa"', GPTLayer, {"attention": "sdpa"}),
    ("GPT", "ours, sdpa, gelu_checkpoint + normalize_invertible", GPTLayer,
     {"attention": "sdpa", **SDPA_OPTIONS}),
    ("GPT", 'ours, attention="materialized"', GPTLayer, {"attention": "materialized"}),
    ("GPT", "ours, materialized, gelu_checkpoint", GPTLayer,
     {"attention": "materialized", "gelu_checkpoint": True}),
    ("GPT", "ours, materialized, attn_dropout_checkpoint", GPTLayer,
     {"attention": "materialized", "attn_dropout_checkpoint": True}),
    ("GPT", "ours, materialized, normalize_invertible", GPTLayer,
     {"attention": "materialized", "normalize_invertible": True}),
    ("GPT", "ours, materialized, all three", GPTLayer,
     {"attention": "materialized", **ALL_THREE}),
]
GENERATED = {"BERT": BertLayer, "GPT": GPTLayer}


def generated_layer(group: str, options: dict, size: Size, device: torch.device,
                    dtype: torch.dtype) -> torch.nn.Module:
    """The group's generated layer; every one of a group gets the same weights (seed 0)."""
    torch.manual_seed(0)
    return GENERATED[group](size.hidden, size.heads, size.intermediate, DROPOUT, DROPOUT,
                            device=device, dtype=dtype, **options)


def hf_bert(layer: BertLayer) -> torch.nn.Module:
    """transformers' BertLayer holding `layer`'s weights (query, key and value unstacked)."""
    config = transformers.BertConfig(
        hidden_size=layer.hidden_size, num_attention_heads=layer.num_heads,
        intermediate_size=layer.intermediate_size, hidden_dropout_prob=layer.hidden_dropout_ratio,
        attention_probs_dropout_prob=layer.attn_dropout_ratio,
        layer_norm_eps=layer.layer_norm_eps, hidden_act="gelu", attn_implementation="sdpa")
    q, k, v = layer.attn_qkvw.detach().chunk(3)
    qb, kb, vb = layer.attn_qkvb.detach().chunk(3)
    state = {
        "attention.self.query.weight": q, "attention.self.query.bias": qb,
        "attention.self.key.weight": k, "attention.self.key.bias": kb,
        "attention.self.value.weight": v, "attention.self.value.bias": vb,
        "attention.output.dense.weight": layer.attn_ow,
        "attention.output.dense.bias": layer.attn_ob,
        "attention.output.LayerNorm.weight": layer.attn_nw,
        "attention.output.LayerNorm.bias": layer.attn_nb,
        "intermediate.dense.weight": layer.inter_w, "intermediate.dense.bias": layer.inter_b,
        "output.dense.weight": layer.output_w, "output.dense.bias": layer.output_b,
        "output.LayerNorm.weight": layer.norm_w, "output.LayerNorm.bias": layer.norm_b,
    }
    return _loaded(HFBertLayer(config), state, layer)


#: GPTLayer parameter -> (GPT2Block parameter, transposed: GPT-2's Conv1D keeps (in, out))
GPT2_NAMES = {
    "ln_1_weight": ("ln_1.weight", False), "ln_1_bias": ("ln_1.bias", False),
    "attn_qkv_weight": ("attn.c_attn.weight", True), "attn_qkv_bias": ("attn.c_attn.bias", False),
    "attn_proj_weight": ("attn.c_proj.weight", True),
    "attn_proj_bias": ("attn.c_proj.bias", False),
    "ln_2_weight": ("ln_2.weight", False), "ln_2_bias": ("ln_2.bias", False),
    "mlp_fc_weight": ("mlp.c_fc.weight", True), "mlp_fc_bias": ("mlp.c_fc.bias", False),
    "mlp_proj_weight": ("mlp.c_proj.weight", True), "mlp_proj_bias": ("mlp.c_proj.bias", False),
}


def hf_gpt2(layer: GPTLayer) -> torch.nn.Module:
    """transformers' GPT2Block holding `layer`'s weights."""
    config = transformers.GPT2Config(
        n_embd=layer.hidden_size, n_head=layer.num_heads, n_inner=layer.intermediate_size,
        resid_pdrop=layer.hidden_dropout_ratio, attn_pdrop=layer.attn_dropout_ratio,
        embd_pdrop=0.0, layer_norm_epsilon=layer.layer_norm_eps, activation_function="gelu_new",
        attn_implementation="sdpa")
    params = dict(layer.named_parameters())
    state = {theirs: params[ours].detach().T if transposed else params[ours]
             for ours, (theirs, transposed) in GPT2_NAMES.items()}
    return _loaded(GPT2Block(config, layer_idx=0), state, layer)


def _loaded(hf: torch.nn.Module, state: dict, like: torch.nn.Module) -> torch.nn.Module:
    reference = next(like.parameters())
    hf = hf.to(device=reference.device, dtype=reference.dtype)
    hf.load_state_dict({name: tensor.detach().clone() for name, tensor in state.items()})
    return hf


def build(group: str, kind, options: dict, size: Size, device: torch.device,
          dtype: torch.dtype) -> torch.nn.Module:
    if kind == "hf":
        base = generated_layer(group, {}, size, device, dtype)
        return (hf_bert if group == "BERT" else hf_gpt2)(base).train()
    return generated_layer(group, options, size, device, dtype).train()


def inputs(group: str, size: Size, device: torch.device, dtype: torch.dtype):
    """(x requiring grad, upstream gradient, mask): BERT's additive padding mask, GPT none."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    shape = (size.batch, size.seq, size.hidden)
    x = torch.randn(shape, generator=generator).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=generator).to(device, dtype)
    mask = None
    if group == "BERT":
        mask = torch.zeros(size.batch, 1, 1, size.seq, device=device, dtype=dtype)
        mask[0, ..., size.seq // 2:] = -10000.0
    return x, dy, mask


def forward(layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # by keyword: GPT2Block's second positional argument is its cache
    out = layer(x, attention_mask=mask)
    return out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple


def _clear(layer: torch.nn.Module, x: torch.Tensor) -> None:
    x.grad = None
    for param in layer.parameters():
        param.grad = None


def step_ms(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
            mask: torch.Tensor | None, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of `repeats` forward + backward steps (CUDA events; wall clock on
    the CPU), after `warmup` steps (Triton's JIT)."""
    cuda = x.is_cuda
    times = []
    for index in range(warmup + repeats):
        _clear(layer, x)
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        forward(layer, x, mask).backward(dy)
        if cuda:
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - began) * 1e3
        if index >= warmup:
            times.append(elapsed)
    _clear(layer, x)
    return times


def saved_bytes(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
                mask: torch.Tensor | None) -> int:
    """Bytes of the distinct storages autograd saves during one forward; parameters and the
    input excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    excluded.add(x.untyped_storage().data_ptr())
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward(layer, x, mask)
    out.backward(dy)
    _clear(layer, x)
    return sum(storages.values())


def peak_bytes(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
               mask: torch.Tensor | None) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = forward(layer, x, mask)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    out.backward(dy)
    _clear(layer, x)
    return peak


def error_vs(layer: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor,
             mask: torch.Tensor | None) -> float:
    """max |layer - reference| / max |reference| of the outputs in eval mode (no dropout)."""
    layer.eval()
    reference.eval()
    with torch.no_grad():
        ours = forward(layer, x, mask).float()
        theirs = forward(reference, x, mask).float()
    layer.train()
    reference.train()
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def measure(size_name: str, size: Size, device: torch.device, dtype: torch.dtype,
            repeats: int, warmup: int, progress: Callable[[str], None]) -> list[dict]:
    records = []
    hf_layers: dict[str, torch.nn.Module] = {}
    for group, label, kind, options in ROWS:
        x, dy, mask = inputs(group, size, device, dtype)
        record = {"size": size_name, **asdict(size), "group": group, "label": label,
                  "hf": kind == "hf", "options": options, "ms": None, "ms_repeats": [],
                  "saved_bytes": None, "peak_fwd_bytes": None, "max_err_vs_hf": None,
                  "error": None}
        layer = None
        try:
            layer = build(group, kind, options, size, device, dtype)
            if kind == "hf":
                hf_layers[group] = layer
            elif group in hf_layers:
                record["max_err_vs_hf"] = error_vs(layer, hf_layers[group], x, mask)
            record["saved_bytes"] = saved_bytes(layer, x, dy, mask)
            record["ms_repeats"] = step_ms(layer, x, dy, mask, repeats, warmup)
            record["ms"] = statistics.median(record["ms_repeats"])
            if device.type == "cuda":
                record["peak_fwd_bytes"] = peak_bytes(layer, x, dy, mask)
        except Exception as error:  # noqa: BLE001 - a failing row is recorded, the run goes on
            record["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        del layer  # the HF layer stays in hf_layers for the rows after it
        if device.type == "cuda":
            torch.cuda.empty_cache()
        records.append(record)
        progress(f"{size_name} {group}: {label}: "
                 + (record["error"] or f"{record['ms']:.3f} ms"))
    return records


def _base(record: dict, records: list[dict]) -> dict | None:
    """The generated row of the record's size and group with the same attention, no option."""
    if record["hf"]:
        return None
    attention = record["options"].get("attention")
    for other in records:
        if (other["size"], other["group"]) == (record["size"], record["group"]) \
                and not other["hf"] and other["options"] == {"attention": attention}:
            return None if other is record else other
    return None


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:,.1f}"


def _ratio(value, reference) -> str:
    return "—" if value is None or not reference else f"{value / reference:.2f}"


def _saves(record: dict, base: dict | None, key: str) -> str:
    if base is None or record[key] is None or base[key] is None:
        return "—"
    return f"{(base[key] - record[key]) / MIB:,.1f}"


def table(records: list[dict], size_name: str) -> str:
    lines = ["| layer | variant | step ms | x HF | saved MiB | x HF | peak fwd MiB | x HF "
             "| option cost ms | option saves MiB (saved / peak) | max err vs HF (eval) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    ours = [r for r in records if r["size"] == size_name]
    hf = {r["group"]: r for r in ours if r["hf"]}
    for record in ours:
        reference = hf.get(record["group"], {})
        base = _base(record, records)
        if record["error"]:
            lines.append(f"| {record['group']} | {record['label']} | error: {record['error']} "
                         "| | | | | | | | |")
            continue
        cost = "—"
        if base is not None and base["ms"] is not None:
            delta = record["ms"] - base["ms"]
            cost = f"{delta:+.3f} ({100 * delta / base['ms']:+.0f}%)"
        err = record["max_err_vs_hf"]
        lines.append(
            f"| {record['group']} | {record['label']} | {record['ms']:.3f} | "
            f"{_ratio(record['ms'], reference.get('ms'))} | {_mib(record['saved_bytes'])} | "
            f"{_ratio(record['saved_bytes'], reference.get('saved_bytes'))} | "
            f"{_mib(record['peak_fwd_bytes'])} | "
            f"{_ratio(record['peak_fwd_bytes'], reference.get('peak_fwd_bytes'))} | {cost} | "
            f"{_saves(record, base, 'saved_bytes')} / {_saves(record, base, 'peak_fwd_bytes')} "
            f"| {'—' if err is None else f'{err:.1e}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="large,small",
                        help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, help="timed steps per row (20)")
    parser.add_argument("--out", type=Path, help="write the records as JSON")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny size on the CPU, fp32: tests the harness")
    args = parser.parse_args(argv)
    chosen = names(parser, "--sizes", args.sizes, SIZES)
    env, dtype = user_level_setup(args.cpu_smoke, args.dtype)
    repeats = args.repeats or (2 if args.cpu_smoke else 20)
    warmup = 0 if args.cpu_smoke else WARMUP  # nothing to compile on the CPU
    sizes = {"smoke": SMOKE_SIZE} if args.cpu_smoke else {name: SIZES[name] for name in chosen}
    records = []
    for name, size in sizes.items():
        records += measure(name, size, env.device, dtype, repeats, warmup,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    meta = {**env.info, "dtype": str(dtype).removeprefix("torch."), "repeats": repeats,
            "warmup": warmup,
            "dropout": DROPOUT, "transformers": transformers.__version__,
            "command": shlex.join(["python", "-m", "benchmarks.layers_step",
                                   *(sys.argv[1:] if argv is None else argv)])}
    print(f"# One layer's training step: {meta['device_name']}, torch {meta['torch']}, "
          f"transformers {meta['transformers']}, {meta['dtype']}, dropout {DROPOUT}\n")
    for name, size in sizes.items():
        print(f"{name}: batch {size.batch} x seq {size.seq}, hidden {size.hidden}, "
              f"{size.heads} heads, intermediate {size.intermediate}\n")
        print(table(records, name))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
