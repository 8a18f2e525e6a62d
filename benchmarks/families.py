"""Every language-model class transformers exports, built tiny, patched, and compared in float64
with itself unpatched: the proof that `patch_model` swaps what it can and changes nothing else.

    python -m benchmarks.families [--heads causal,masked,seq2seq,image-text] [--only PATTERNS]
                                  [--jobs N] [--timeout-s 120] [--out FILE.json]

The classes are those of transformers' auto mappings for causal LMs, masked LMs,
sequence-to-sequence LMs and image-text-to-text models (`--heads`), `--only` fnmatch patterns
of their class names. Each class runs in a worker process:

1. its config class's defaults, shrunk (`TINY`: two layers, width 64, a vocabulary of 96, ...,
   in every sub-config), every dropout probability of the config and every Dropout module set
   to 0, MoE experts computed by their eager loop (grouped products take no float64), the
   model built from it in float64, in training mode (the loss routes replace the training
   loss);
2. a copy patched with `patch_model(model, loss=True)`;
3. both run `model(input_ids, labels=...)` (a masked LM's labels on a third of the positions,
   a causal LM's on all but two, a seq2seq model's as its targets) and `loss.backward()`: the
   loss, the logits and every parameter's gradient are compared.

Hugging Face computes some steps in float32 whatever the model's dtype (its RMS norms' upcast,
rotary frequencies): the runs lift every float32 cast and dtype argument to float64 (`lifted`),
so that the unpatched model is exact and a difference is the patch's. A class is then:

- "exact": every value within 1e-9 of the unpatched model's (relative to the largest; see
  `_compare`);
- "differs": some value further off (the largest relative difference, and where);
- "nothing swapped": patch_model found nothing to swap;
- "patched run failed": the patched model raised where the unpatched one did not;
- "not built": the tiny config, the model or its unpatched run raised (not counted against the
  patch; the reason is kept).

Prints the counts and every class that is not exact or not built, and writes every record to
`--out`. CPU only: the generated ops take their torch path, the same derivation as the kernels.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import fnmatch
import json
import os
import signal
import sys
import time
import traceback

#: config attributes set on every config and sub-config that has them
TINY = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "d_ff": 128, "ffn_dim": 128, "n_inner": 128, "hidden_dim": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_heads": 2,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "d_kv": 32, "kv_lora_rank": 32, "q_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "vocab_size": 96, "max_position_embeddings": 64, "n_positions": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
    "sliding_window": 16, "image_size": 32, "patch_size": 8,
    # hybrids of recurrent and attention layers: the second of the two layers attends
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
    "expert_layer_offset": 1,
}
#: list-valued config attributes set as they are (the hybrids' attention layers)
TINY_LISTS = {"attn_layer_indices": [1]}
#: tokens in a batch
BATCH, SEQ = 2, 12
#: the largest relative difference that counts as exact in float64
EXACT = 1e-9
HEADS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}


def classes(heads: list[str], only: str | None) -> list[tuple[str, str, str]]:
    """(head, model type, class name) of every class the auto mappings of `heads` name."""
    from transformers.models.auto import modeling_auto

    found = []
    for head in heads:
        for model_type, names in getattr(modeling_auto, HEADS[head]).items():
            for name in (names,) if isinstance(names, str) else names:
                if only is None or any(fnmatch.fnmatchcase(name, pattern)
                                       for pattern in only.split(",")):
                    found.append((head, model_type, name))
    return sorted(dict.fromkeys(found))


def shrink(config, seen=None) -> None:
    """Set `TINY`'s sizes on `config` and on every sub-config it holds."""
    from transformers import PretrainedConfig

    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    for name, value in TINY.items():
        if hasattr(config, name) and isinstance(getattr(config, name), (int, type(None))) \
                and not isinstance(getattr(config, name), bool):
            try:
                setattr(config, name, value)
            except (AttributeError, ValueError, TypeError):
                pass
    for name, value in TINY_LISTS.items():
        if isinstance(getattr(config, name, None), list):
            with contextlib.suppress(AttributeError, ValueError, TypeError):
                setattr(config, name, list(value))
    for name, value in list(vars(config).items()):
        # dropout, functional ones included (BART's `dropout` attribute): the two runs would
        # draw different masks where a patch changes the order of random draws
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(config, name, 0.0)
    if hasattr(config, "_experts_implementation_internal"):
        # MoE experts through torch's grouped matrix product take no float64: the eager loop
        # over the experts does (and is what an experts swap replaces)
        config._experts_implementation = "eager"
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) \
            and isinstance(getattr(config, "head_dim", None), int):
        # multi-head latent attention (DeepSeek V2/V3 and kin): the rotary embedding's width is
        # head_dim, which the config's own constructor sets to qk_rope_head_dim
        config.head_dim = config.qk_rope_head_dim
    for name in ("layer_types", "block_types", "layers_block_type"):
        kinds = getattr(config, name, None)
        if isinstance(kinds, list) and kinds:
            # two layers, of two kinds where there are several (a hybrid's linear attention
            # and the full attention its masks are made for); a kind list the config derives
            # from its layer count (a property without a setter) follows that count
            distinct = list(dict.fromkeys(kinds))
            with contextlib.suppress(AttributeError):
                setattr(config, name, (distinct + kinds)[:2])
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            shrink(value, seen)


def lifted():
    """A torch function mode under which float32 is float64: every `dtype=torch.float32`,
    `.to(torch.float32)` and `.float()` asks for float64 instead."""
    import torch
    from torch.overrides import TorchFunctionMode

    def lift(value):
        if value is torch.float32:
            return torch.float64
        if isinstance(value, (list, tuple)) and any(v is torch.float32 for v in value):
            return type(value)(lift(v) for v in value)
        return value

    class Lifted(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.float:
                func = torch.Tensor.double
            args = tuple(lift(a) for a in args)
            kwargs = {k: lift(v) for k, v in (kwargs or {}).items()}
            return func(*args, **kwargs)

    return Lifted()


def _inputs(head: str, vocab: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (BATCH, SEQ), generator=generator)
    labels = tokens.clone()
    if head == "masked":
        keep = torch.rand((BATCH, SEQ), generator=generator) < 1 / 3
        keep[:, 0] = True
        labels[~keep] = -100
    elif head != "seq2seq":
        labels[0, 3] = labels[1, -2] = -100
    return tokens, labels


def _run(model, head, tokens, labels):
    """(loss, logits, {parameter: gradient}) of one training step."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # what draws at random draws the same in both runs
    output = model(input_ids=tokens, labels=labels)
    loss = output.loss
    loss.backward()
    logits = getattr(output, "logits", None)
    return (loss.detach(), logits.detach() if logits is not None else None,
            {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None})


def _relative(a, b, floor: float = 1e-30) -> float:
    """The largest difference of `b` from `a` over the largest magnitude of `a` (at least
    `floor`)."""
    if not a.numel():
        return 0.0
    return float((a - b).abs().max()) / max(float(a.abs().max()), floor)


def _compare(want, got) -> tuple[float, str]:
    """The largest relative difference of loss, logits and gradients, and where. A gradient is
    measured against its own largest value, or a millionth of the largest of all gradients
    where that is more (a key bias's gradient is 0 but for rounding). The logits count where
    both models return them (a loss route returns none in training, as Liger's does)."""
    (loss, logits, grads), (loss2, logits2, grads2) = want, got
    worst = (_relative(loss.reshape(1), loss2.reshape(1)), "loss")
    if logits is not None and logits2 is not None:
        worst = max(worst, (_relative(logits, logits2), "logits")
                    if logits.shape == logits2.shape
                    else (float("inf"), f"logits of shape {tuple(logits2.shape)}"))
    largest = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    for name in sorted(set(grads) | set(grads2)):
        if name not in grads or name not in grads2:
            worst = max(worst, (float("inf"), f"gradient of {name} in one model only"))
        else:
            worst = max(worst, (_relative(grads[name], grads2[name], 1e-6 * largest),
                                f"gradient of {name}"))
    return worst


def _error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def check(head: str, model_type: str, name: str, timeout_s: int) -> dict:
    """One class's record (see the module's docstring)."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from codegen.runtime import dispatch
    from generated.patch import patch_model

    def alarm(*_):
        raise TimeoutError(f"over {timeout_s} s")

    handler = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout_s)
    record = {"head": head, "model_type": model_type, "class": name}
    start = time.perf_counter()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        # the generated path at every size, not torch's expression nor the model's own code
        # that CPU calls run otherwise: what is compared is the derivation's
        with lifted(), dispatch.forcing("kernels"):
            try:
                config = CONFIG_MAPPING[model_type]()
                shrink(config)
                torch.manual_seed(0)
                model = getattr(transformers, name)(config).to(torch.float64)
                for module in model.modules():
                    if isinstance(module, torch.nn.Dropout):
                        module.p = 0.0
                model.train()
                vocab = model.get_output_embeddings().weight.shape[0] \
                    if model.get_output_embeddings() is not None else TINY["vocab_size"]
                tokens, labels = _inputs(head, min(vocab, TINY["vocab_size"]))
                patched = copy.deepcopy(model)
                want = _run(model, head, tokens, labels)
                if not torch.isfinite(want[0]):
                    raise ValueError("the unpatched loss is not finite")
            except Exception as error:  # noqa: BLE001 - recorded, not the patch's
                record.update(result="not built", reason=_error(error))
                return record
            try:
                report = patch_model(patched, loss=True)
            except Exception as error:  # noqa: BLE001
                record.update(result="patch_model raised", reason=_error(error),
                              trace=traceback.format_exc(limit=-4))
                return record
            record["swapped"] = report.counts
            record["skipped"] = [f"{s.name} ({s.old}): {s.reason}" for s in report.skipped]
            if not report.swapped:
                record["result"] = "nothing swapped"
                return record
            try:
                got = _run(patched, head, tokens, labels)
            except Exception as error:  # noqa: BLE001
                record.update(result="patched run failed", reason=_error(error),
                              trace=traceback.format_exc(limit=-4))
                return record
            difference, where = _compare(want, got)
            record.update(result="exact" if difference <= EXACT else "differs",
                          difference=difference, where=where)
            return record
    except TimeoutError as error:
        record.update(result="not built", reason=_error(error))
        return record
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, handler)
        torch.set_default_dtype(dtype)
        record["seconds"] = round(time.perf_counter() - start, 2)


def _worker() -> None:
    """A worker process's setup: the generated ops on their torch path, not Triton's
    interpreter (whole models on the interpreter take minutes a step)."""
    os.environ.pop("TRITON_INTERPRET", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=",".join(HEADS))
    parser.add_argument("--only", default=None,
                        help="fnmatch patterns of class names, comma-separated")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout-s", type=int, default=120)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    heads = args.heads.split(",")
    unknown = [h for h in heads if h not in HEADS]
    if unknown:
        parser.error(f"--heads: unknown {', '.join(unknown)}; known: {', '.join(HEADS)}")
    todo = classes(heads, args.only)
    records = []
    # a fresh process per class: patches, class swaps and default dtypes stay in it
    with concurrent.futures.ProcessPoolExecutor(args.jobs, max_tasks_per_child=1,
                                                initializer=_worker) as pool:
        futures = [pool.submit(check, *item, args.timeout_s) for item in todo]
        for future, item in zip(futures, todo, strict=True):
            try:
                record = future.result()
            except Exception as error:  # noqa: BLE001 - a worker that died
                record = {"head": item[0], "model_type": item[1], "class": item[2],
                          "result": "not built", "reason": f"worker died: {_error(error)}"}
            records.append(record)
            print(f"{record['result']:>18}  {record['class']}"
                  + (f"  {record.get('reason') or record.get('where') or ''}"
                     if record["result"] not in ("exact",) else ""), flush=True)
    counts: dict[str, int] = {}
    for record in records:
        counts[record["result"]] = counts.get(record["result"], 0) + 1
    print(f"\n{len(records)} classes: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(records, file, indent=1)
    return 0 if not any(r["result"] in ("differs", "patched run failed", "patch_model raised")
                        for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
