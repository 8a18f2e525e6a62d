"""Whole Hugging Face models: a training step of the model as it is, patched with
`generated.patch.patch_model`, patched by Liger-Kernel, and under torch.compile.

    python -m benchmarks.models [--models gpt2,bert,llama,...] [--sizes small,large]
                                [--variants eager,patched,liger] [--steps 10]
                                [--rounds 1] [--budget-s 220] [--timeout-s 300]
                                [--out FILE.json]
                                [--cpu-smoke [--jobs N]]

Models, randomly initialised from a config (seed 0; no download), bf16, attn_implementation
"sdpa" (Gemma 2: "eager", which transformers requires for its soft-capped scores), training
mode with the config's dropout:

| model | size | hidden | layers | heads | batch x seq | vocabulary |
|---|---|---|---|---|---|---|
| gpt2 | small | 768 | 4 | 12 | 1 x 128 | 50257 |
| gpt2 | large | 1024 | 8 | 16 | 8 x 1024 | 50257 |
| bert | small | 768 | 4 | 12 | 1 x 128 | 30522 |
| bert | large | 1024 | 8 | 16 | 16 x 512 | 30522 |
| llama | small | 1024 | 4 | 16 | 1 x 256 | 32000 |
| llama | large | 2048 | 8 | 32 | 2 x 2048 | 32000 |
| llama3 | small | 1024 | 4 | 16 | 1 x 256 | 128256 |
| llama3 | large | 2048 | 8 | 32 | 4 x 2048 | 128256 |
| mistral | small | 1024 | 4 | 16 | 1 x 256 | 32768 |
| mistral | large | 2048 | 8 | 16 | 2 x 2048 | 32768 |
| qwen2 | small | 1024 | 4 | 16 | 1 x 256 | 151936 |
| qwen2 | large | 1536 | 8 | 12 | 2 x 2048 | 151936 |
| qwen3 | small | 1024 | 4 | 16 | 1 x 256 | 151936 |
| qwen3 | large | 2048 | 8 | 16 | 2 x 2048 | 151936 |
| gemma | small | 1024 | 4 | 8 | 1 x 256 | 256000 |
| gemma | large | 2048 | 8 | 8 | 2 x 2048 | 256000 |
| gemma2 | small | 1024 | 4 | 8 | 1 x 256 | 256000 |
| gemma2 | large | 2304 | 8 | 8 | 2 x 2048 | 256000 |
| gemma3 | small | 1152 | 4 | 4 | 1 x 256 | 262144 |
| gemma3 | large | 1152 | 8 | 4 | 2 x 2048 | 262144 |
| phi3 | small | 1024 | 4 | 16 | 1 x 256 | 32064 |
| phi3 | large | 3072 | 8 | 32 | 2 x 2048 | 32064 |
| mixtral | small | 1024 | 4 | 16 | 1 x 256 | 32000 |
| mixtral | large | 2048 | 8 | 16 | 2 x 2048 | 32000 |

gpt2: GPT2LMHeadModel. bert: BertForMaskedLM, 15% of the positions labelled. llama:
LlamaForCausalLM, 4 key-value heads, intermediate 2.75 x hidden; llama3 the same with Llama 3's
vocabulary and 8 key-value heads (Llama-3.2-1B's shape at 8 layers). mistral:
MistralForCausalLM, 8 key-value heads (4 small), intermediate 3.5 x hidden. qwen2:
Qwen2ForCausalLM, 2 key-value heads, intermediate 5.5 x hidden. qwen3: Qwen3ForCausalLM (a
norm of each head's query and key), 8 key-value heads (4 small), head dim 128, intermediate 3 x
hidden. gemma: GemmaForCausalLM, 1 key-value head, head dim 256, intermediate 8 x hidden,
tanh-GELU MLP. gemma2: Gemma2ForCausalLM, 4 key-value heads, head dim 256, intermediate 4 x
hidden, its logit soft-capping. gemma3: Gemma3ForCausalLM (text), 1 key-value head, head dim
256, intermediate 6 x hidden, every sixth layer global, the others a sliding window of 512.
phi3: Phi3ForCausalLM (fused query/key/value and gate/up projections), intermediate 8/3 x
hidden. mixtral: MixtralForCausalLM, 8 experts (4 small) of intermediate 2 x hidden, 2 per
token, 8 key-value heads (4 small).

A step is `model(input_ids=..., labels=...).loss.backward()` from gradients set to None (no
optimizer). Variants:

- eager: the model as transformers builds it;
- patched: after `generated.patch.patch_model(model, loss=True)` (a causal LM's training loss
  from its hidden states through `linear_cross_entropy`, as Liger's fused linear
  cross-entropy; BERT's masked-LM loss from its labelled rows' hidden states), each op
  choosing between its kernels and torch's expression of it by its measured size
  (codegen/runtime/dispatch.py);
- patched-no-loss: after `patch_model(model)` (the loss is the model's own);
- patched-kernels, patched-kernels-compiled: the same with the kernels at every size
  (`VJPFORGE_DISPATCH=kernels`), eager and under `torch.compile(model)`;
- liger: after Liger-Kernel's `apply_liger_kernel_to_<model type>(model=model)` with its
  defaults (Llama: RoPE, RMSNorm, SwiGLU MLP and the fused linear cross-entropy;
  `apply_liger_kernel_to_gemma3_text` for gemma3, `_llama` for llama3); "n/a" where Liger has
  no such function (GPT-2, BERT), "unavailable" where Liger does not import;
- compiled, patched-compiled: `torch.compile(model)` (default mode) of the original and of the
  patched model;
- reduce-overhead, patched-reduce-overhead: `torch.compile(model, mode="reduce-overhead")`
  (CUDA graphs), `torch.compiler.cudagraph_mark_step_begin()` before each step.

Each variant runs in a process of its own (Liger and the patch replace classes and functions
of transformers' modules), which prints one JSON line; this process starts them one after the
other and assembles the tables. Per variant: step ms (CUDA events around each step, median of
`--steps` after warm-up; a compiled variant's first step is its compile s, wall clock), the
peak of `torch.cuda.max_memory_allocated` over the timed steps (parameters, gradients and
activations), and the loss in eval mode (no dropout) of the same batch, which every
uncompiled variant of a model must reproduce (same weights, same computation).
`--rounds R` runs every variant of a model R times, interleaved, every other round in the
opposite order (eager, patched, liger, liger, patched, eager, ...), each time in a new process:
a shared machine's speed drifts between processes by more than the differences measured, and
interleaving exposes each variant to the same drift. The
table gives the median of the rounds' step times and, with R > 1, their range; the peak is the
largest of the rounds'.

A failure (an exception, out of memory, a crash, the `--timeout-s` of a variant) is reported
with its error, and the run goes on; no variant starts after `--budget-s` seconds (the rest
are reported as skipped). `--cpu-smoke` runs tiny models on the CPU in fp32 with wall-clock
steps and the compiled variants with backend "eager" (dynamo only): it tests the harness; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = ("gpt2", "bert", "llama", "llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
          "gemma3", "phi3", "mixtral")
SIZE_NAMES = ("small", "large")
VARIANTS = ("eager", "patched", "patched-no-loss", "liger", "compiled", "patched-compiled",
            "reduce-overhead", "patched-reduce-overhead", "patched-kernels",
            "patched-kernels-compiled")
DEFAULT_VARIANTS = ("eager", "patched", "liger")
COMPILED = {"compiled": "default", "patched-compiled": "default",
            "patched-kernels-compiled": "default",
            "reduce-overhead": "reduce-overhead", "patched-reduce-overhead": "reduce-overhead"}
WARMUP = 3
"""Untimed steps before the timed ones (the first is a compiled variant's compile)."""
GIB = 2**30
BERT_LABELLED = 0.15
#: a status other than ok: the variant has no step time
STATUSES = ("ok", "error", "oom", "timeout", "n/a", "unavailable", "skipped")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    batch: int
    seq: int
    heads: int
    vocab: int


SIZES = {
    ("gpt2", "small"): Size(768, 4, 1, 128, 12, 50257),
    ("gpt2", "large"): Size(1024, 8, 8, 1024, 16, 50257),
    ("bert", "small"): Size(768, 4, 1, 128, 12, 30522),
    ("bert", "large"): Size(1024, 8, 16, 512, 16, 30522),
    ("llama", "small"): Size(1024, 4, 1, 256, 16, 32000),
    ("llama", "large"): Size(2048, 8, 2, 2048, 32, 32000),
    ("llama3", "small"): Size(1024, 4, 1, 256, 16, 128256),
    ("llama3", "large"): Size(2048, 8, 4, 2048, 32, 128256),
    ("mistral", "small"): Size(1024, 4, 1, 256, 16, 32768),
    ("mistral", "large"): Size(2048, 8, 2, 2048, 16, 32768),
    ("qwen2", "small"): Size(1024, 4, 1, 256, 16, 151936),
    ("qwen2", "large"): Size(1536, 8, 2, 2048, 12, 151936),
    ("qwen3", "small"): Size(1024, 4, 1, 256, 16, 151936),
    ("qwen3", "large"): Size(2048, 8, 2, 2048, 16, 151936),
    ("gemma", "small"): Size(1024, 4, 1, 256, 8, 256000),
    ("gemma", "large"): Size(2048, 8, 2, 2048, 8, 256000),
    ("gemma2", "small"): Size(1024, 4, 1, 256, 8, 256000),
    ("gemma2", "large"): Size(2304, 8, 2, 2048, 8, 256000),
    ("gemma3", "small"): Size(1152, 4, 1, 256, 4, 262144),
    ("gemma3", "large"): Size(1152, 8, 2, 2048, 4, 262144),
    ("phi3", "small"): Size(1024, 4, 1, 256, 16, 32064),
    ("phi3", "large"): Size(3072, 8, 2, 2048, 32, 32064),
    ("mixtral", "small"): Size(1024, 4, 1, 256, 16, 32000),
    ("mixtral", "large"): Size(2048, 8, 2, 2048, 16, 32000),
}
SMOKE_SIZE = Size(64, 2, 2, 16, 2, 256)
LIGER_FUNCTION = "apply_liger_kernel_to_{}"
#: models whose Liger function is not named after them
LIGER_NAMES = {"llama3": "llama", "gemma3": "gemma3_text"}


def liger_function(model: str) -> str:
    return LIGER_FUNCTION.format(LIGER_NAMES.get(model, model))


# ---- one variant, in its own process -----------------------------------------------------

def build_model(model: str, size: Size, device):
    """The model class instance from its config, in fp32 (seed 0), initialised on `device`
    (a GPU initialises a large model in a fraction of the CPU's time)."""
    import torch
    import transformers

    common = {"attn_implementation": "sdpa"}
    decoder = {"vocab_size": size.vocab, "hidden_size": size.hidden,
               "num_hidden_layers": size.layers, "num_attention_heads": size.heads,
               "max_position_embeddings": max(2048, size.seq), **common}
    smoke = size.hidden < 256
    # fewer key-value heads (and experts) at the small size, never more than the heads
    kv = min(4 if size.layers <= 4 else 8, size.heads)
    wide_head = size.hidden // size.heads if smoke else 256
    if model == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=size.vocab, n_positions=max(1024, size.seq), n_embd=size.hidden,
            n_layer=size.layers, n_head=size.heads, **common)
        cls = transformers.GPT2LMHeadModel
    elif model == "bert":
        config = transformers.BertConfig(
            vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
            num_attention_heads=size.heads, intermediate_size=4 * size.hidden,
            max_position_embeddings=max(512, size.seq), **common)
        cls = transformers.BertForMaskedLM
    elif model in ("llama", "llama3"):
        config = transformers.LlamaConfig(
            intermediate_size=int(2.75 * size.hidden),
            num_key_value_heads=min(4, size.heads) if model == "llama" else kv, **decoder)
        cls = transformers.LlamaForCausalLM
    elif model == "mistral":
        config = transformers.MistralConfig(
            intermediate_size=int(3.5 * size.hidden), num_key_value_heads=kv, **decoder)
        cls = transformers.MistralForCausalLM
    elif model == "qwen2":
        config = transformers.Qwen2Config(
            intermediate_size=int(5.5 * size.hidden), num_key_value_heads=2, **decoder)
        cls = transformers.Qwen2ForCausalLM
    elif model == "qwen3":
        config = transformers.Qwen3Config(
            intermediate_size=3 * size.hidden, num_key_value_heads=kv,
            head_dim=size.hidden // size.heads if smoke else 128, **decoder)
        cls = transformers.Qwen3ForCausalLM
    elif model == "gemma":
        config = transformers.GemmaConfig(
            intermediate_size=8 * size.hidden, num_key_value_heads=1,
            head_dim=wide_head if size.hidden >= 1024 or smoke else size.hidden // size.heads,
            hidden_activation="gelu_pytorch_tanh", **decoder)
        cls = transformers.GemmaForCausalLM
    elif model == "gemma2":
        # its soft-capped attention scores: transformers refuses sdpa for Gemma 2
        config = transformers.Gemma2Config(
            intermediate_size=4 * size.hidden, num_key_value_heads=min(4, size.heads),
            head_dim=wide_head, **{**decoder, "attn_implementation": "eager"})
        cls = transformers.Gemma2ForCausalLM
    elif model == "gemma3":
        config = transformers.Gemma3TextConfig(
            intermediate_size=6 * size.hidden, num_key_value_heads=1, head_dim=wide_head,
            sliding_window=512, **decoder)
        cls = transformers.Gemma3ForCausalLM
    elif model == "phi3":
        config = transformers.Phi3Config(
            intermediate_size=8 * size.hidden // 3, num_key_value_heads=size.heads,
            pad_token_id=0, **decoder)
        cls = transformers.Phi3ForCausalLM
    elif model == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=2 * size.hidden, num_key_value_heads=kv,
            num_local_experts=4 if size.layers <= 4 else 8, num_experts_per_tok=2, **decoder)
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config)


def make_batch(model: str, size: Size, device) -> dict:
    """input_ids and labels (seed 1): the next-token labels of a causal LM are its inputs
    (transformers shifts them); BERT labels a random 15% of the positions (masked LM)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator)
    labels = ids.clone()
    if model == "bert":
        unlabelled = torch.rand(ids.shape, generator=generator) >= BERT_LABELLED
        unlabelled[:, 0] = False  # at least one label per sequence
        labels[unlabelled] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def _swap_counts(report) -> dict[str, int]:
    """What patch_model reports as swapped, as {class name: count}: a mapping of counts, or a
    report with a `swapped` list of (qualified name, old class, new class)."""
    swapped = getattr(report, "swapped", None)
    if swapped is None:
        return {str(kind): int(count) for kind, count in dict(report).items()}
    counts: dict[str, int] = {}
    for entry in swapped:
        old = entry[1]
        name = old if isinstance(old, str) else getattr(old, "__name__", str(old))
        counts[name] = counts.get(name, 0) + 1
    return counts


def _skipped(report) -> list[str]:
    return [" ".join(map(str, entry)) for entry in getattr(report, "skipped", None) or []]


def prepare(variant: str, model_name: str, model) -> dict:
    """Patch `model` in place as `variant` asks; what was done, for the record."""
    done: dict = {}
    if variant.startswith("patched"):
        from generated.patch import patch_model

        report = patch_model(model, loss=variant != "patched-no-loss")
        done["swapped"] = _swap_counts(report)
        if skipped := _skipped(report):
            done["not_swapped"] = skipped
    elif variant == "liger":
        import liger_kernel.transformers as liger

        name = liger_function(model_name)
        getattr(liger, name)(model=model)
        done["liger"] = name
    return done


def _elapsed_ms(device, run) -> float:
    import torch

    if device.type != "cuda":
        began = time.perf_counter()
        run()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run_variant(spec: dict) -> dict:
    """One (model, size, variant): build, patch, measure; the record printed as JSON."""
    import torch

    variant, model_name = spec["variant"], spec["model"]
    size = Size(**spec["size_config"])
    smoke = spec["cpu_smoke"]
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    record = {key: spec[key] for key in ("model", "size", "variant")}
    record["device_name"] = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    model = build_model(model_name, size, device).to(dtype=dtype)
    record["parameters"] = sum(p.numel() for p in model.parameters())
    record.update(prepare(variant, model_name, model))
    batch = make_batch(model_name, size, device)
    if variant not in COMPILED:
        model.eval()
        with torch.no_grad():
            record["eval_loss"] = float(model(**batch).loss)
    model.train()
    call = model
    mode = COMPILED.get(variant)
    if mode is not None:
        options = {"backend": "eager"} if smoke else {"mode": mode}
        record["compile"] = ", ".join(f"{k}={v}" for k, v in options.items())
        call = torch.compile(model, **options)

    def clear() -> None:
        for param in model.parameters():
            param.grad = None

    def step() -> None:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        call(**batch).loss.backward()

    for index in range(spec["warmup"]):
        clear()
        began = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index == 0 and mode is not None:
            record["compile_s"] = time.perf_counter() - began
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    record["step_ms_repeats"] = []
    for _ in range(spec["steps"]):
        clear()
        record["step_ms_repeats"].append(_elapsed_ms(device, step))
    record["step_ms"] = statistics.median(record["step_ms_repeats"])
    if device.type == "cuda":
        record["peak_bytes"] = torch.cuda.max_memory_allocated()
    record["status"] = "ok"
    return record


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    if spec["cpu_smoke"]:
        import torch

        os.environ.pop("TRITON_INTERPRET", None)  # the generated torch path
        torch.set_num_threads(1)  # tiny tensors: threads cost more than they share
    try:
        record = run_variant(spec)
    except Exception as error:  # noqa: BLE001 - every failure becomes the variant's record
        import torch

        status = "oom" if isinstance(error, torch.OutOfMemoryError) else "error"
        record = {key: spec[key] for key in ("model", "size", "variant")}
        record.update(status=status, error=_first_line(error))
    print(json.dumps(record), flush=True)
    return 0


def _first_line(error: BaseException) -> str:
    lines = f"{type(error).__name__}: {error}".strip().splitlines()
    return lines[0][:500] if lines else type(error).__name__


# ---- the parent: which variants, in which processes, and the tables -------------------------

def liger_functions() -> tuple[set[str] | None, str]:
    """Which of the models Liger-Kernel has an apply_liger_kernel_to_<model> for, or None and
    why it does not import."""
    try:
        import liger_kernel.transformers as liger
    except ModuleNotFoundError as error:
        return None, f"liger-kernel is not installed ({error})"
    except Exception as error:  # noqa: BLE001 - any import failure makes Liger unavailable
        return None, f"liger_kernel does not import: {_first_line(error)}"
    return {model for model in MODELS if hasattr(liger, liger_function(model))}, ""


def plan(models: list[str], sizes: list[str], variants: list[str], smoke: bool,
         steps: int, rounds: int = 1) -> list[dict]:
    """One spec per process to run: each model and size, `rounds` times its variants in turn,
    every other round in the opposite order."""
    # a compiled variant's first step compiles; on the CPU nothing else needs warming up
    return [{"model": model, "size": size, "variant": variant, "cpu_smoke": smoke,
             "steps": steps, "warmup": 1 if smoke else WARMUP, "round": index,
             "size_config": asdict(SMOKE_SIZE if smoke else SIZES[model, size])}
            for model in models for size in sizes for index in range(rounds)
            for variant in (variants if index % 2 == 0 else variants[::-1])]


def merge_rounds(records: list[dict]) -> list[dict]:
    """One record per (model, size, variant), in first-seen order: where several rounds ran,
    the median of their step times (`step_ms_rounds` holds each), the largest peak, and the
    first failure where any round failed."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["model"], record["size"], record["variant"]), []).append(record)
    merged = []
    for group in groups.values():
        failed = [r for r in group if r.get("status") != "ok"]
        if failed or len(group) == 1:
            merged.append(failed[0] if failed else group[0])
            continue
        times = [r["step_ms"] for r in group]
        record = {**group[0], "step_ms": statistics.median(times), "step_ms_rounds": times}
        peaks = [r["peak_bytes"] for r in group if r.get("peak_bytes") is not None]
        if peaks:
            record["peak_bytes"] = max(peaks)
        merged.append(record)
    return merged


def _base(spec: dict) -> dict:
    return {key: spec[key] for key in ("model", "size", "variant")}


def run_child(spec: dict, timeout_s: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if spec["cpu_smoke"]:
        env.pop("TRITON_INTERPRET", None)
    # "-kernels" variants: the generated kernels at every size (codegen/runtime/dispatch.py)
    env.pop("VJPFORGE_DISPATCH", None)
    if "-kernels" in spec["variant"]:
        env["VJPFORGE_DISPATCH"] = "kernels"
    began = time.perf_counter()
    command = [sys.executable, "-m", "benchmarks.models", "--child", json.dumps(spec)]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {**_base(spec), "status": "timeout",
                "error": f"no result within --timeout-s {timeout_s:g} s", "wall_s": timeout_s}
    wall = time.perf_counter() - began
    for line in reversed(done.stdout.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("variant") == spec["variant"]:
            return {**record, "wall_s": wall}
    tail = " | ".join(done.stderr.strip().splitlines()[-3:])[-500:]
    return {**_base(spec), "status": "error", "wall_s": wall,
            "error": f"process exited {done.returncode} without a result: {tail}"}


def run_all(specs: list[dict], budget_s: float, timeout_s: float, jobs: int,
            progress) -> list[dict]:
    """Every spec's record, in order: Liger's absence and models it has no function for are
    decided here; the rest run in processes of their own, `jobs` at a time."""
    functions, why = (None, "")
    if any(spec["variant"] == "liger" for spec in specs):
        functions, why = liger_functions()
    began = time.perf_counter()
    records: list[dict | None] = [None] * len(specs)
    pending = []
    for index, spec in enumerate(specs):
        if spec["variant"] == "liger":
            if functions is None:
                records[index] = {**_base(spec), "status": "unavailable", "error": why}
            elif spec["model"] not in functions:
                records[index] = {**_base(spec), "status": "n/a", "error": "Liger-Kernel has no "
                                  + liger_function(spec["model"])}
        if records[index] is None:
            pending.append(index)

    def one(index: int) -> dict:
        if time.perf_counter() - began > budget_s:
            return {**_base(specs[index]), "status": "skipped",
                    "error": f"--budget-s {budget_s:g} s spent before it started"}
        record = run_child(specs[index], timeout_s)
        progress(f"{record['model']} {record['size']} {record['variant']}: "
                 + (f"{record['step_ms']:.2f} ms" if record.get("status") == "ok"
                    else f"{record['status']}: {record.get('error', '')}"))
        return record

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for index, record in zip(pending, pool.map(one, pending), strict=True):
            records[index] = record
    return [record for record in records if record is not None]


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:,.{digits}f}"


def _ratio(value, reference) -> str:
    return "—" if value is None or not reference else f"{value / reference:.2f}"


def table(records: list[dict], variants: tuple[str, ...]) -> str:
    """Markdown table of the records of `variants`: step ms and peak GiB against eager (and,
    for a compiled variant, against the compiled original), the eval loss against eager's."""
    chosen = [r for r in records if r["variant"] in variants]
    if not chosen:
        return ""
    by_key = {(r["model"], r["size"], r["variant"]): r for r in records}
    lines = ["| model | size | variant | step ms | x eager | x compiled | peak GiB | x eager "
             "| compile s | eval loss | vs eager | swapped / status |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in chosen:
        eager = by_key.get((r["model"], r["size"], "eager"), {})
        compiled = by_key.get((r["model"], r["size"], "compiled"), {})
        ok = r.get("status") == "ok"
        if not ok:
            note = f"{r.get('status')}: {r.get('error', '')}".replace("|", "/")
        elif "swapped" in r:
            note = ", ".join(f"{kind} {count}" for kind, count in r["swapped"].items()) or "none"
        else:
            note = r.get("liger", "—")
        loss, base_loss = r.get("eval_loss"), eager.get("eval_loss")
        delta = "—"
        if loss is not None and base_loss is not None and r["variant"] != "eager":
            delta = f"{abs(loss - base_loss) / max(abs(base_loss), 1e-30):.1e}"
        peak = r.get("peak_bytes")
        step = _fmt(r.get("step_ms"))
        if len(spread := r.get("step_ms_rounds") or ()) > 1:
            step += f" ({_fmt(min(spread))}–{_fmt(max(spread))})"
        lines.append(
            f"| {r['model']} | {r['size']} | {r['variant']} | {step} | "
            f"{_ratio(r.get('step_ms'), eager.get('step_ms'))} | "
            f"{_ratio(r.get('step_ms'), compiled.get('step_ms')) if r['variant'] in COMPILED else '—'} | "  # noqa: E501
            f"{_fmt(None if peak is None else peak / GIB)} | "
            f"{_ratio(peak, eager.get('peak_bytes'))} | {_fmt(r.get('compile_s'), 1)} | "
            f"{_fmt(loss, 4)} | {delta} | {note} |")
    return "\n".join(lines) + "\n"


def _choices(parser, option: str, value: str, allowed) -> list[str]:
    names = [name for name in value.split(",") if name]
    if unknown := sorted(set(names) - set(allowed)):
        parser.error(f"{option}: no such {option[2:-1]} {', '.join(unknown)} "
                     f"(choices: {', '.join(allowed)})")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default=",".join(SIZE_NAMES))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, help="timed steps per variant (10)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every variant, interleaved; the table gives their median")
    parser.add_argument("--budget-s", type=float, default=220.0,
                        help="no variant starts after this many seconds")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="a variant's process is stopped after this many seconds")
    parser.add_argument("--jobs", type=int, default=1,
                        help="variants run at once (only with --cpu-smoke: GPU steps are timed "
                             "one process at a time)")
    parser.add_argument("--out", type=Path, help="write the records as JSON")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny models on the CPU, fp32: tests the harness")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    models = _choices(parser, "--models", args.models, MODELS)
    sizes = _choices(parser, "--sizes", args.sizes, SIZE_NAMES)
    variants = _choices(parser, "--variants", args.variants, VARIANTS)
    if args.jobs < 1 or (args.jobs > 1 and not args.cpu_smoke):
        parser.error(f"--jobs: more than 1 only with --cpu-smoke, at least 1; got {args.jobs}")
    if args.cpu_smoke:
        sizes = sizes[:1]  # one tiny size stands for both
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible; use --cpu-smoke for a CPU smoke test")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    steps = args.steps or (2 if args.cpu_smoke else 10)
    specs = plan(models, sizes, variants, args.cpu_smoke, steps, args.rounds)
    began = time.perf_counter()
    records = run_all(specs, args.budget_s, args.timeout_s, args.jobs,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    records = merge_rounds(records)
    named = [r["device_name"] for r in records if r.get("device_name")]
    meta = {"device": named[0] if named else "unknown",
            "dtype": "float32" if args.cpu_smoke else "bfloat16", "steps": steps,
            "warmup": 1 if args.cpu_smoke else WARMUP, "rounds": args.rounds,
            "wall_s": time.perf_counter() - began,
            "versions": _versions(),
            "sizes": {f"{m} {s}": asdict(SMOKE_SIZE if args.cpu_smoke else SIZES[m, s])
                      for m in models for s in sizes},
            "command": shlex.join(["python", "-m", "benchmarks.models",
                                   *(sys.argv[1:] if argv is None else argv)])}
    print(f"# Training step of whole models: {meta['device']}, {meta['dtype']}, "
          f"{', '.join(f'{k} {v}' for k, v in meta['versions'].items())}\n")
    plain = tuple(v for v in VARIANTS if v not in COMPILED)
    for title, group in (("Models", plain), ("Compiled models", tuple(COMPILED))):
        if text := table(records, group):
            print(f"{title}:\n\n{text}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    return 0


def _versions() -> dict[str, str]:
    import importlib.metadata

    versions = {}
    for name in ("torch", "triton", "transformers", "liger-kernel"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


if __name__ == "__main__":
    sys.exit(main())
