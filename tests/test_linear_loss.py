"""linear_cross_entropy (the loss of a linear layer's outputs, chunk by chunk over the rows)
against torch's cross_entropy(F.linear(...)), and patch_model(loss=True) computing a Hugging Face
causal-LM model's training loss from its hidden states."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers  # a declared test dependency (the `test` extra): import, never skip
from reference import FP64_TOL, generated_torch_path, randn
from transformers.modeling_outputs import CausalLMOutputWithPast

from codegen.runtime import launch, linear_loss
from generated import cross_entropy as cross_entropy_module
from generated.cross_entropy import LinearCrossEntropyLoss, cross_entropy, linear_cross_entropy
from generated.patch import patch_model

OP = cross_entropy_module  # for the `schedule` fixture
H, V = 8, 37  # features; classes (three column blocks of the looped schedule)
SHAPE = (3, 5)  # rows: 15, which chunks of 4 or 7 do not divide
REDUCTIONS = ("none", "mean", "sum")
TOL = {torch.float64: FP64_TOL, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


def case(dtype, device, *, bias=True, ignored=(1, 9), ignore_index=-100, class_weight=False,
         seed=0):
    """input (3, 5, H), weight (V, H), bias (V,) (or None), target (3, 5) with ignore_index at
    the flat positions `ignored`, class weights (V,) or None."""
    x = randn((*SHAPE, H), seed=seed, dtype=dtype, device=device)
    weight = randn((V, H), seed=seed + 1, dtype=dtype, device=device)
    b = randn((V,), seed=seed + 2, dtype=dtype, device=device) if bias else None
    generator = torch.Generator().manual_seed(seed + 3)
    target = torch.randint(0, V, SHAPE, generator=generator)
    target.view(-1)[list(ignored)] = ignore_index
    weights = (torch.rand(V, generator=generator, dtype=dtype) + 0.5).to(device) \
        if class_weight else None
    return x, weight, b, target.to(device), weights


def theirs(x, weight, bias, target, class_weight=None, reduction="mean", **options):
    logits = F.linear(x, weight, bias)
    loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), weight=class_weight,
                           reduction=reduction, **options)
    return loss.reshape(target.shape) if reduction == "none" else loss


def loss_and_grads(fn, x, weight, bias, seed=9):
    """fn's loss and the gradients of a random combination of it in x, weight and bias."""
    tensors = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    loss = fn(*tensors, *([None] if bias is None else []))
    upstream = randn(loss.shape, seed=seed, dtype=loss.dtype, device=loss.device)
    return loss.detach(), torch.autograd.grad(loss, tensors, upstream)


def assert_matches(dtype, device, reduction, *, bias=True, class_weight=False, chunk_size=4,
                   **options):
    x, weight, b, target, weights = case(dtype, device, bias=bias, class_weight=class_weight,
                                         ignore_index=options.get("ignore_index", -100))
    ours = loss_and_grads(lambda x, w, b: linear_cross_entropy(
        x, w, target, b, reduction=reduction, class_weight=weights, chunk_size=chunk_size,
        **options), x, weight, b)
    exact = loss_and_grads(lambda x, w, b: theirs(
        x, w, b, target, weights, reduction, **options), x, weight, b)
    torch.testing.assert_close(ours[0], exact[0], **TOL[dtype])
    assert ours[0].dtype == dtype
    for name, got, want in zip(("input", "weight", "bias"), ours[1], exact[1], strict=False):
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.25, "class_weight": True},
                                     {"ignore_index": 4, "bias": False}])
def test_matches_cross_entropy_of_linear_torch_path(monkeypatch, reduction, dtype, options):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_matches(dtype, torch.device("cpu"), reduction, **options)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_cross_entropy_of_linear_kernels(device, reduction):
    """The Triton kernels (interpreted without a GPU), weights and smoothing and 7-row chunks."""
    assert_matches(torch.float32, device, reduction, class_weight=True, label_smoothing=0.25,
                   chunk_size=7)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 100, None])
def test_chunk_sizes_agree(monkeypatch, chunk_size):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_matches(torch.float64, torch.device("cpu"), "mean", chunk_size=chunk_size,
                   class_weight=True)


def test_logits_are_held_a_chunk_at_a_time(monkeypatch):
    """The kernels see chunks of at most chunk_size rows, and every row once per pass."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = []
    kernels = cross_entropy_module._linear_kernels

    def recording(*args):
        bound = kernels(*args)
        return bound._replace(
            forward=lambda x, *a: seen.append(x.shape) or bound.forward(x, *a))

    monkeypatch.setattr(cross_entropy_module, "_linear_kernels", recording)
    x, weight, b, target, _ = case(torch.float64, "cpu")
    x.requires_grad_()
    for reduction, passes in (("mean", 1), ("none", 2)):  # "none" computes them again
        seen.clear()
        loss = linear_cross_entropy(x, weight, target, b, reduction=reduction, chunk_size=4)
        loss.sum().backward()
        assert seen == [(4, V), (4, V), (4, V), (3, V)] * passes


@pytest.mark.parametrize("smallest", [8, 16])  # one row chunk a block; two
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_blocks_of_classes(monkeypatch, reduction, smallest):
    """Where d weight is wanted, the backward takes the classes a block at a time (the loss's
    backward kernels on a window of the row: the column index and the row length are the
    whole row's, so smoothing and class weights come out right), each block over the rows in
    one chunk, or in two with d weight summed in fp32."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(linear_loss, "MIN_BLOCK_CLASSES", smallest)
    seen = []
    kernels = cross_entropy_module._linear_kernels

    def recording(*args):
        bound = kernels(*args)
        assert bound.windowed

        def backward(x, target, outputs, dloss, col_start=0, row_length=None):
            seen.append((x.shape, col_start, row_length))
            return bound.backward(x, target, outputs, dloss, col_start, row_length)

        return bound._replace(backward=backward)

    monkeypatch.setattr(cross_entropy_module, "_linear_kernels", recording)
    assert_matches(torch.float64, "cpu", reduction, class_weight=True, label_smoothing=0.25)
    # chunks of 4 rows: blocks of 4 * 37 // 15 = 9 classes (at least `smallest`), each over
    # as many rows as 4 * 37 logits hold
    block = max(9, smallest)
    rows = min(15, 4 * V // block)
    expected = [((min(rows, 15 - start), min(block, V - first)), first, V)
                for first in range(0, V, block) for start in range(0, 15, rows)]
    assert seen == expected


def test_backward_blocks_take_at_most_block_bytes(monkeypatch):
    """The blocked backward runs while the step's activations are all held: its logits block
    takes at most BLOCK_BYTES, whatever the forward's chunk, and the gradients stay exact."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(linear_loss, "MIN_BLOCK_CLASSES", 4)
    monkeypatch.setattr(linear_loss, "BLOCK_BYTES", 15 * 9 * 8)  # 15 rows of 9 fp64 classes
    seen = []
    kernels = cross_entropy_module._linear_kernels

    def recording(*args):
        bound = kernels(*args)

        def backward(x, *rest):
            seen.append(x.shape)
            return bound.backward(x, *rest)

        return bound._replace(backward=backward)

    monkeypatch.setattr(cross_entropy_module, "_linear_kernels", recording)
    # one forward chunk of every row: its logits would make a single block of every class
    assert_matches(torch.float64, "cpu", "mean", class_weight=True, label_smoothing=0.25,
                   chunk_size=15)
    assert seen == [(15, min(9, V - first)) for first in range(0, V, 9)]


def test_default_chunk_takes_about_the_input_memory_above_a_floor():
    # Liger-Kernel's example: 16384 rows of 4096 features, 32000 classes: 2048 rows a chunk
    # hold the input's memory; 128 MiB of bf16 logits take 2098 rows, 2176 in steps of 128
    assert linear_loss.chunk_rows("f", 16384, 4096, 32000, None) == 2176
    assert linear_loss.chunk_rows("f", 16384, 4096, 32000, None, 4) == 2048  # fp32: 1049
    assert linear_loss.chunk_rows("f", 65536, 4096, 32000, None) == 8192  # the input's
    # Qwen2's head: 4096 / 99 -> 64 rows, raised to 442 -> 512; Gemma's: 263 -> 384
    assert linear_loss.chunk_rows("f", 4096, 1536, 151936, None) == 512
    assert linear_loss.chunk_rows("f", 4096, 2048, 256000, None) == 384
    assert linear_loss.chunk_rows("f", 15, 8, 37, None) == 15  # never past the rows
    assert linear_loss.chunk_rows("f", 15, 8, 37, 100) == 15
    assert linear_loss.chunk_rows("f", 15, 8, 37, 4) == 4


def test_only_the_gradients_asked_for(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float64, "cpu")
    weight.requires_grad_()
    loss = linear_cross_entropy(x, weight, target, b, chunk_size=4)
    (grad,) = torch.autograd.grad(loss, weight)
    (want,) = torch.autograd.grad(theirs(x, weight, b, target), weight)
    torch.testing.assert_close(grad, want, **FP64_TOL)
    with torch.no_grad():  # no gradient: one pass, the same loss
        torch.testing.assert_close(linear_cross_entropy(x, weight, target, b), loss.detach(),
                                   **FP64_TOL)


def test_one_dim_input_and_no_rows(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float64, "cpu")
    ours = linear_cross_entropy(x[0, 0], weight, target[0, 0], b)
    torch.testing.assert_close(ours, F.cross_entropy(F.linear(x[0, 0], weight, b),
                                                     target[0, 0]), **FP64_TOL)
    empty = x[:0].requires_grad_()
    for reduction in REDUCTIONS:
        got = linear_cross_entropy(empty, weight, target[:0], b, reduction=reduction)
        want = theirs(empty, weight, b, target[:0], reduction=reduction)
        torch.testing.assert_close(got, want, equal_nan=True)


def test_all_ignored_mean_is_nan_with_zero_gradients(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float64, "cpu", ignored=range(15))
    loss, grads = loss_and_grads(lambda x, w, b: linear_cross_entropy(x, w, target, b),
                                 x, weight, b)
    assert loss.isnan()
    assert all(bool((g == 0).all()) for g in grads)


def test_out_dtype_and_autocast(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float32, "cpu")
    low = [t.bfloat16() for t in (x, weight, b)]
    # out_dtype=float32: the loss of the 16-bit logits unrounded, as cross_entropy(logits.float())
    got = linear_cross_entropy(*low[:2], target, low[2], out_dtype=torch.float32)
    want = F.cross_entropy(F.linear(*low).float().reshape(-1, V), target.reshape(-1))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert linear_cross_entropy(*low[:2], target, low[2]).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as F.linear, then cross_entropy
        got = linear_cross_entropy(x, weight, target, b)
        want = F.cross_entropy(F.linear(x, weight, b).reshape(-1, V), target.reshape(-1))
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_double_backward_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float64, "cpu")
    x.requires_grad_()
    for reduction in ("mean", "none"):
        loss = linear_cross_entropy(x, weight, target, b, reduction=reduction).sum()
        with pytest.raises(RuntimeError, match="double backward .* is not supported"):
            torch.autograd.grad(loss, x, create_graph=True)


def test_a_second_backward_of_a_reduced_loss_is_refused_and_none_recomputes(monkeypatch):
    """Reduced: the gradients computed in the forward are handed over by the first backward,
    scaled in place (a d weight the size of the weight, never copied); a second backward says
    so. "none" recomputes its chunks, so retain_graph works there as for torch's loss."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float64, "cpu")
    x.requires_grad_()
    for reduction in ("mean", "sum"):
        loss = linear_cross_entropy(x, weight, target, b, reduction=reduction)
        first, = torch.autograd.grad(3 * loss, x, retain_graph=True)
        torch.testing.assert_close(first, 3 * torch.autograd.grad(
            theirs(x, weight, b, target, reduction=reduction), x)[0], **FP64_TOL)
        with pytest.raises(RuntimeError, match="second time .* not supported"):
            torch.autograd.grad(loss, x)
    loss = linear_cross_entropy(x, weight, target, b, reduction="none").sum()
    first, = torch.autograd.grad(loss, x, retain_graph=True)
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], first, rtol=0, atol=0)


def test_logit_gradients_overwrite_the_chunk_buffer(device):
    """The loss kernels' backward writes d loss / d logits into the chunk's logits (the
    buffer is not read again): no second (chunk, classes) buffer on the kernels' path."""
    x, weight, b, target, _ = case(torch.float32, device)
    target = target.reshape(-1)
    kernels = cross_entropy_module._linear_kernels(None, -100, 0.0, 0.0, 0.0, 0.0)
    logits = F.linear(x.reshape(-1, H), weight, b).contiguous()
    leaf = logits.clone().requires_grad_()
    expected, = torch.autograd.grad(F.cross_entropy(leaf, target, reduction="sum"), leaf)
    outputs = kernels.forward(logits, target, True)
    upstream = torch.ones(logits.shape[0], dtype=torch.float32, device=device)
    got = kernels.backward(logits, target, outputs, upstream)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])
    assert (got.data_ptr() == logits.data_ptr()) == launch.use_triton(logits)


def test_errors_name_the_argument(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float32, "cpu")
    calls = [
        (lambda: linear_cross_entropy(x, weight.double(), target), TypeError,
         "argument 'weight' must have the dtype of 'input' .*float32.*got torch.float64"),
        (lambda: linear_cross_entropy(x, weight, target, b.double()), TypeError,
         "argument 'bias' must have the dtype"),
        (lambda: linear_cross_entropy(x.long(), weight, target), TypeError,
         "argument 'input' must have dtype"),
        (lambda: linear_cross_entropy(x, weight[:, :5], target), ValueError,
         r"argument 'weight' must have shape \(classes, 8\)"),
        (lambda: linear_cross_entropy(x, weight, target, b[:5]), ValueError,
         r"argument 'bias' must have shape \(37,\)"),
        (lambda: linear_cross_entropy(x, weight, target[:2]), ValueError,
         "argument 'target' must have shape"),
        (lambda: linear_cross_entropy(x, weight, target.float()), TypeError,
         "argument 'target' must hold integer class indices"),
        (lambda: linear_cross_entropy(x, weight, torch.full(SHAPE, V)), IndexError,
         r"argument 'target' must hold class indices in \[0, 37\)"),
        (lambda: linear_cross_entropy(x, weight, target, class_weight=torch.ones(5)),
         ValueError, r"argument 'class_weight' must have shape \(37,\)"),
        (lambda: linear_cross_entropy(x, weight, target, chunk_size=0), ValueError,
         "argument 'chunk_size' must be at least 1"),
        (lambda: linear_cross_entropy(x, weight, target, chunk_size=2.0), TypeError,
         "argument 'chunk_size' must be an int"),
        (lambda: linear_cross_entropy(x, weight, target, reduction="avg"), ValueError,
         "argument 'reduction' must be one of"),
        (lambda: linear_cross_entropy(x, weight, target, label_smoothing=2.0), ValueError,
         "argument 'label_smoothing' must be in"),
        (lambda: linear_cross_entropy(x, weight, target, out_dtype=torch.int64), TypeError,
         "argument 'out_dtype' must be None or one of"),
    ]
    for call, error, message in calls:
        with pytest.raises(error, match=message):
            call()


def test_module(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, weights = case(torch.float64, "cpu", class_weight=True)
    module = LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.25, class_weight=weights,
                                    chunk_size=4)
    assert list(module.state_dict()) == ["class_weight"]
    assert repr(module) == ("LinearCrossEntropyLoss(label_smoothing=0.25, reduction='sum', "
                            "chunk_size=4)")
    assert repr(LinearCrossEntropyLoss()) == "LinearCrossEntropyLoss()"
    torch.testing.assert_close(module(x, weight, target, b),
                               theirs(x, weight, b, target, weights, "sum",
                                      label_smoothing=0.25), **FP64_TOL)


# Hugging Face causal-LM models

VOCAB = 64


def tiny_causal_lm(kind: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    configs = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}
    config_class, model_class = configs[kind]
    config = config_class(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=16, intermediate_size=64,
                          vocab_size=VOCAB, **extra)
    return model_class(config).train()


def lm_step(model, tokens, labels, **kwargs):
    model.zero_grad()
    torch.manual_seed(5)  # the same dropout draws in both models
    out = model(input_ids=tokens, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def torch_path(monkeypatch):
    """The generated torch path on the CPU (the Triton interpreter is slow for whole models)."""
    generated_torch_path(monkeypatch)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_causal_lm_training_loss_from_hidden_states(torch_path, kind):
    original = tiny_causal_lm(kind, attention_dropout=0.1)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="loss")
    assert report.swapped == [("loss_function", "ForCausalLMLoss",
                               "linear_cross_entropy(hidden states, lm_head)")]
    assert report.skipped == []
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = tokens.masked_fill(torch.rand(tokens.shape, generator=torch.Generator()
                                           .manual_seed(2)) < 0.3, -100)
    shifted = labels.roll(-1, dims=-1)
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(11)}, {"shift_labels": shifted}):
        out, grads = lm_step(original, tokens, labels, **kwargs)
        patched_out, patched_grads = lm_step(patched, tokens, labels, **kwargs)
        assert patched_out.logits is None  # never computed whole
        assert patched_out.loss.dtype == torch.float32
        torch.testing.assert_close(patched_out.loss, out.loss, rtol=1e-6, atol=0)
        assert patched_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"{n}: {m}")
    # return_dict=False: the tuple without the logits, as transformers leaves out a None
    loss, *rest = patched(input_ids=tokens, labels=labels, return_dict=False)
    assert not any(isinstance(t, torch.Tensor) and t.shape[-1] == VOCAB for t in rest)
    # no labels, or eval mode: the logits, as the model's own
    for model in (original, patched):
        model.eval()
    with torch.no_grad():
        want = original(input_ids=tokens, labels=labels)
        got = patched(input_ids=tokens, labels=labels)
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(patched(input_ids=tokens).logits, want.logits)
    # a copy of the patched model routes its own loss; patching again changes nothing
    again = copy.deepcopy(patched).train()
    assert patch_model(again, include="loss").swapped == []
    assert again.loss_function.__self__.model is again


def test_a_compiled_patched_model_takes_its_loss_from_the_logits(torch_path):
    # a compiled graph is the model's own forward: the logits and their loss, as the original
    original = tiny_causal_lm("llama")
    patched = copy.deepcopy(original)
    patch_model(patched, include="loss")
    compiled = torch.compile(patched, backend="aot_eager")
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    out, grads = lm_step(original, tokens, tokens)
    for _ in range(2):  # a second step runs the compiled graph
        got, got_grads = lm_step(compiled, tokens, tokens)
        torch.testing.assert_close(got.logits, out.logits)
        torch.testing.assert_close(got.loss, out.loss)
        assert got_grads.keys() == {f"_orig_mod.{name}" for name in grads}
        for name in grads:
            torch.testing.assert_close(got_grads[f"_orig_mod.{name}"], grads[name])


def test_softcapped_logits_cap_in_the_loss(torch_path):
    """Gemma 2 caps its logits before the loss: the routed forward sets the config's cap
    aside and the loss takes it as its softcap; the loss and every gradient are the model's."""
    original = tiny_causal_lm("gemma2", final_logit_softcapping=3.0)
    patched = copy.deepcopy(original)
    report = patch_model(patched, include="loss")
    assert report.swapped == [("loss_function", "ForCausalLMLoss",
                               "linear_cross_entropy(hidden states, lm_head)")]
    assert report.skipped == []
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[0, :3] = -100
    out, grads = lm_step(original, tokens, labels)
    patched_out, patched_grads = lm_step(patched, tokens, labels)
    assert patched_out.logits is None
    torch.testing.assert_close(patched_out.loss, out.loss, rtol=1e-6, atol=0)
    for name in grads:
        torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert patched.config.final_logit_softcapping == 3.0  # set back after each forward
    patched.eval()
    original.eval()
    with torch.no_grad():  # eval: the model's own capped logits
        torch.testing.assert_close(patched(input_ids=tokens).logits,
                                   original(input_ids=tokens).logits)


class ScaledLlamaForCausalLM(transformers.LlamaForCausalLM):
    """A causal LM whose forward scales the logits before its loss."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = 2 * self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = None if labels is None else self.loss_function(logits, labels, VOCAB)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_forward_that_changes_the_logits_keeps_the_logits_route(torch_path):
    model = ScaledLlamaForCausalLM(tiny_causal_lm("llama").config)
    report = patch_model(model, include="loss")
    [(name, kind, reason)] = report.skipped
    assert (name, kind) == ("forward", "ScaledLlamaForCausalLM")
    assert "did not hand lm_head's output to its loss_function unchanged" in reason, reason
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    model = tiny_causal_lm("llama")
    model.lm_head.register_forward_hook(lambda module, args, output: 2 * output)
    [(_, _, reason)] = patch_model(model, include="loss").skipped
    assert reason.endswith("its lm_head has forward_hooks of its own, which would see the "
                           "stand-in for the logits"), reason


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_softcap_and_z_loss_pass_through(device, reduction):
    """The loss's own options beyond torch's (Gemma 2's logit softcap, the z-loss) reach every
    chunk: the results of cross_entropy on the whole logits with the same options."""
    options = {"softcap": 3.0, "lse_square_scale": 1e-2, "label_smoothing": 0.1}
    x, weight, b, target, _ = case(torch.float64, device)
    ours = loss_and_grads(lambda x, w, b: linear_cross_entropy(
        x, w, target, b, reduction=reduction, chunk_size=4, **options), x, weight, b)
    exact = loss_and_grads(lambda x, w, b: cross_entropy(
        F.linear(x, w, b), target, reduction=reduction, class_dim=-1, **options), x, weight, b)
    torch.testing.assert_close(ours[0], exact[0], **TOL[torch.float64])
    for got, want in zip(ours[1], exact[1], strict=True):
        torch.testing.assert_close(got, want, **TOL[torch.float64])
    # and they change the loss: the options were not dropped on the way
    plain = linear_cross_entropy(x, weight, target, b, reduction=reduction, chunk_size=4)
    assert not torch.allclose(plain, ours[0])


RETURNED = ("return_z_loss", "return_token_accuracy", "return_predicted_tokens")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("grad", ["none", "input", "weight"])  # no backward; rows; blocked
def test_returns_z_loss_accuracy_and_predictions(device, reduction, grad):
    """return_z_loss, return_token_accuracy and return_predicted_tokens: cross_entropy's
    values on the whole logits, taken chunk by chunk (4 rows a chunk: the last one short) by
    every path of the forward (no gradient; the gradients computed in the forward or rows
    again; the blocked classes), the loss and its gradients unchanged by asking for them."""
    options = {"softcap": 3.0, "lse_square_scale": 1e-2, "label_smoothing": 0.1}
    x, weight, b, target, weights = case(torch.float64, device, class_weight=True)
    # a tie of the row max across column blocks of the classes, in every row: the first
    # class is predicted, a target at the second is missed
    weight[[7, 12, 30]] = weight[12].clone()
    b[[7, 12, 30]] = 100.0
    target.view(-1)[[0, 2, 3]] = torch.tensor([7, 12, 30], device=target.device)
    flags = dict.fromkeys(RETURNED, True)
    leaves = [t.detach().requires_grad_(name in grad) for t, name in
              ((x, "input"), (weight, "weight"), (b, "bias"))]
    ours = linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction,
                                class_weight=weights, chunk_size=4, **options, **flags)
    exact = cross_entropy(F.linear(x, weight, b), target, weights, reduction=reduction,
                          class_dim=-1, **options, **flags)
    assert len(ours) == 4
    for got, want in zip(ours[:2], exact[:2], strict=True):
        torch.testing.assert_close(got, want, **TOL[torch.float64])
    assert torch.equal(ours[2], exact[2]) and torch.equal(ours[3], exact[3])
    logits = F.linear(x, weight, b)
    predicted = ours[3]
    assert predicted.dtype == torch.int64 and predicted.shape == target.shape
    counted = target != -100
    assert torch.equal(predicted, torch.where(
        counted, torch.argmax(3.0 * torch.tanh(logits / 3.0), -1), -1))
    assert (predicted[counted] == 7).all() and (predicted[~counted] == -1).all()  # ties: first
    if reduction == "none":
        assert ours[2].view(-1)[[0, 2, 3]].tolist() == [1.0, 0.0, 0.0]
    assert not any(t.requires_grad for t in ours[1:])
    if grad != "none":
        plain = linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction,
                                     class_weight=weights, chunk_size=4, **options)
        torch.testing.assert_close(ours[0], plain, rtol=0, atol=0)
        upstream = torch.ones_like(plain)
        got = torch.autograd.grad(ours[0], [t for t in leaves if t.requires_grad], upstream)
        want = torch.autograd.grad(plain, [t for t in leaves if t.requires_grad], upstream)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_returned_one_at_a_time_and_module(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, b, target, _ = case(torch.float32, "cpu")
    logits = F.linear(x, weight, b)
    loss, accuracy = linear_cross_entropy(x, weight, target, b, return_token_accuracy=True)
    counted = target != -100
    want = ((torch.argmax(logits, -1) == target) & counted).sum() / counted.sum()
    assert accuracy.dtype == torch.float32 and accuracy.item() == pytest.approx(want.item())
    loss, z_loss = linear_cross_entropy(x, weight, target, b, return_z_loss=True)
    assert torch.equal(z_loss, torch.zeros_like(z_loss))  # lse_square_scale 0: no z-loss
    module = LinearCrossEntropyLoss(return_predicted_tokens=True, chunk_size=4)
    assert module.extra_repr() == "chunk_size=4, return_predicted_tokens=True"
    loss, predicted = module(x, weight, target, b)
    assert torch.equal(predicted, torch.where(counted, torch.argmax(logits, -1), -1))
    for name in RETURNED:
        with pytest.raises(TypeError, match=f"linear_cross_entropy\\(\\): argument '{name}' "
                                            "must be a bool, got int"):
            linear_cross_entropy(x, weight, target, b, **{name: 1})
        with pytest.raises(TypeError, match=f"LinearCrossEntropyLoss\\(\\): argument '{name}' "
                                            "must be a bool, got str"):
            LinearCrossEntropyLoss(**{name: "yes"})


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_rows_with_every_gradient_and_the_returned_values(monkeypatch, reduction):
    # no rows and a weight that needs a gradient (the blocked path): the returned values are
    # cross_entropy's of no logits, the gradients zeros, as torch's
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros((0, H), dtype=torch.float64, requires_grad=True)
    weight = randn((V, H), seed=1).requires_grad_()
    bias = randn((V,), seed=2).requires_grad_()
    target = torch.zeros(0, dtype=torch.int64)
    flags = dict.fromkeys(RETURNED, True)
    ours = linear_cross_entropy(x, weight, target, bias, reduction=reduction, **flags)
    exact = cross_entropy(F.linear(x, weight, bias), target, reduction=reduction, class_dim=-1,
                          **flags)
    for got, want in zip(ours, exact, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    grads = torch.autograd.grad(ours[0].sum(), (x, weight, bias))
    assert grads[0].shape == (0, H)
    assert torch.equal(grads[1], torch.zeros_like(weight))
    assert torch.equal(grads[2], torch.zeros_like(bias))
