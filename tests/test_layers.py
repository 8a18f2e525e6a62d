"""The generated transformer layers (block specs in derive/layers/): BertLayer and GPTLayer.

Against plain-PyTorch reference layers (tests/layer_reference.py) and against Hugging Face's
BertLayer and GPT2Block: the output, the input gradient and every parameter gradient in fp64 for
each option. Finite differences (also with dropout, under a fixed seed), dropout determinism,
bad input, and, on a GPU, bf16 numerics and a 4-layer training step.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # a declared test dependency (the `test` extra): import, never skip
from layer_reference import ReferenceLayer
from reference import BAD_INPUT, FP64_TOL, HAS_CUDA, generated_torch_path, randn, select_path

from derive.blocks import HELPERS
from generated import bert_layer, gpt_layer
from generated.bert_layer import BertLayer
from generated.gpt_layer import GPTLayer

# head_dim 8: the scale 8 ** -0.5 is not an fp32 number (fp64 must keep it exactly)
HIDDEN, HEADS, INTER, BATCH, SEQ = 16, 2, 32, 2, 5
LAYERS = {"bert": BertLayer, "gpt": GPTLayer}

# Each option alone, then together (every layer takes every option but pre_layer_norm, which
# only the BERT layer has: the GPT layer is pre-LN).
CASES = {
    "bert": [{}, {"pre_layer_norm": True}, {"gelu_checkpoint": True},
             {"attn_dropout_checkpoint": True}, {"normalize_invertible": True},
             {"attention": "sdpa"},
             {"pre_layer_norm": True, "attention": "sdpa", "normalize_invertible": True},
             {"pre_layer_norm": True, "gelu_checkpoint": True, "attn_dropout_checkpoint": True,
              "normalize_invertible": True}],
    "gpt": [{}, {"attention": "materialized"}, {"gelu_checkpoint": True},
            {"attention": "materialized", "attn_dropout_checkpoint": True},
            {"normalize_invertible": True},
            {"attention": "materialized", "gelu_checkpoint": True,
             "attn_dropout_checkpoint": True, "normalize_invertible": True}],
}
PARAMS = [(kind, options) for kind, cases in CASES.items() for options in cases]


def case_id(case: tuple[str, dict]) -> str:
    kind, options = case
    return "-".join([kind, *(k if v is True else f"{k}={v}" for k, v in options.items())])


def build(kind: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64,
          dropout: float = 0.0, sizes: tuple[int, int, int] = (HIDDEN, HEADS, INTER),
          seed: int = 0, **options: object) -> torch.nn.Module:
    """A layer with random parameters of a trained layer's scale: GEMM weights ~ 1/sqrt(fan_in),
    biases ~ 0.1, LayerNorm weights ~ 1 +- 0.2 (so every gradient path is exercised)."""
    layer = LAYERS[kind](*sizes, dropout, dropout, device=device, dtype=dtype, **options)
    with torch.no_grad():
        for i, (name, param) in enumerate(layer.named_parameters()):
            noise = randn(param.shape, seed=seed + i, device=device, dtype=dtype)
            if param.dim() == 2:
                param.copy_(noise / math.sqrt(param.shape[1]))
            elif name.endswith(("nw", "norm_w", "weight")):  # LayerNorm weights
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)
    return layer


def additive_mask(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64,
                  batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    """BERT's extended padding mask (batch, 1, 1, seq): the last two keys of batch 0 padded."""
    mask = torch.zeros(batch, 1, 1, seq, device=device, dtype=dtype)
    mask[0, ..., -2:] = -10000.0
    return mask


def run(module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None,
        grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """{output, hidden_states (its gradient), each parameter's gradient} of one step."""
    module.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    out = module(leaf, mask)
    out.backward(grad)
    results = {"output": out.detach(), "hidden_states": leaf.grad}
    results.update({name: p.grad for name, p in module.named_parameters()})
    return results


def assert_results_close(ours: dict, theirs: dict, **tol: float) -> None:
    assert ours.keys() == theirs.keys()
    for name, expected in theirs.items():
        assert ours[name] is not None, f"{name}: no gradient"
        torch.testing.assert_close(ours[name], expected, msg=lambda m, n=name: f"{n}: {m}",
                                   **tol)


@pytest.mark.parametrize("case", PARAMS, ids=map(case_id, PARAMS))
def test_matches_reference_fp64(device, case):
    kind, options = case
    layer = build(kind, device=device, **options).train()
    reference = ReferenceLayer.like(layer)
    x = randn((BATCH, SEQ, HIDDEN), seed=100, device=device)
    grad = randn((BATCH, SEQ, HIDDEN), seed=101, device=device)
    mask = additive_mask(device)
    assert_results_close(run(layer, x, mask, grad), run(reference, x, mask, grad), **FP64_TOL)
    with torch.no_grad():
        torch.testing.assert_close(layer.eval()(x, mask), reference.eval()(x, mask), **FP64_TOL)


@pytest.mark.parametrize("case", PARAMS, ids=map(case_id, PARAMS))
def test_dropout_path_matches_reference_at_tiny_p(case):
    """With dropout on, the layer takes its dropout path (bias_dropout_add then layer_norm,
    dropout in the masked softmax); at p = 1e-12 every element is kept (scaled by 1 + 1e-12), so
    that path must give the reference layer's step without dropout."""
    kind, options = case
    torch.manual_seed(0)
    layer = build(kind, dropout=1e-12, **options).train()
    reference = ReferenceLayer.like(build(kind, **options)).train()
    x = randn((BATCH, SEQ, HIDDEN), seed=100)
    grad = randn((BATCH, SEQ, HIDDEN), seed=101)
    mask = additive_mask()
    # every kept element is scaled by 1 / (1 - 1e-12): the step differs from the reference's
    # by about 1e-12 relative before any rounding, more after the norms divide
    assert_results_close(run(layer, x, mask, grad), run(reference, x, mask, grad),
                         rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("mask_kind", ["none", "bool", "full"])
def test_masks_match_reference(kind, mask_kind):
    """No mask, a bool keep-mask, and a full (batch, heads, seq, seq) additive one; both
    attention kinds."""
    x = randn((BATCH, SEQ, HIDDEN), seed=100)
    grad = randn((BATCH, SEQ, HIDDEN), seed=101)
    mask = {"none": None, "bool": additive_mask() == 0,
            "full": randn((BATCH, HEADS, SEQ, SEQ), seed=102)}[mask_kind]
    for attention in ("materialized", "sdpa"):
        layer = build(kind, attention=attention)
        reference = ReferenceLayer.like(layer)
        assert_results_close(run(layer, x, mask, grad), run(reference, x, mask, grad),
                             **FP64_TOL)


def hf_bert(layer: BertLayer) -> torch.nn.Module:
    config = transformers.BertConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=INTER,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
        hidden_act="gelu", attn_implementation="eager")
    hf = transformers.models.bert.modeling_bert.BertLayer(config).double()
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
    hf.load_state_dict({name: t.detach().clone() for name, t in state.items()})
    return hf


def hf_bert_grads(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF's gradients under our parameter names (query/key/value stacked)."""
    g = {name: p.grad for name, p in hf.named_parameters()}
    stack = lambda part: torch.cat([g[f"attention.self.{n}.{part}"]  # noqa: E731
                                    for n in ("query", "key", "value")])
    return {"attn_qkvw": stack("weight"), "attn_qkvb": stack("bias"),
            "attn_ow": g["attention.output.dense.weight"],
            "attn_ob": g["attention.output.dense.bias"],
            "attn_nw": g["attention.output.LayerNorm.weight"],
            "attn_nb": g["attention.output.LayerNorm.bias"],
            "inter_w": g["intermediate.dense.weight"], "inter_b": g["intermediate.dense.bias"],
            "output_w": g["output.dense.weight"], "output_b": g["output.dense.bias"],
            "norm_w": g["output.LayerNorm.weight"], "norm_b": g["output.LayerNorm.bias"]}


# GPTLayer name -> (GPT2Block name, transposed: Conv1D keeps (in, out))
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
    config = transformers.GPT2Config(
        n_embd=HIDDEN, n_head=HEADS, n_inner=INTER, resid_pdrop=0.0, attn_pdrop=0.0,
        embd_pdrop=0.0, layer_norm_epsilon=1e-5, activation_function="gelu_new",
        attn_implementation="eager")
    hf = transformers.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0).double()
    params = dict(layer.named_parameters())
    hf.load_state_dict({theirs: (params[ours].T if transposed else params[ours]).detach().clone()
                        for ours, (theirs, transposed) in GPT2_NAMES.items()})
    return hf


@pytest.mark.parametrize("attention", ["materialized", "sdpa"])
def test_loads_hf_bert_layer(attention):
    layer = build("bert", attention=attention).eval()
    hf = hf_bert(layer).eval()
    x = randn((BATCH, SEQ, HIDDEN), seed=100)
    grad = randn((BATCH, SEQ, HIDDEN), seed=101)
    mask = additive_mask()
    ours = run(layer, x, mask, grad)
    leaf = x.clone().requires_grad_()
    out = hf(leaf, attention_mask=mask)
    out = out[0] if isinstance(out, tuple) else out  # transformers 4 returns (hidden,)
    out.backward(grad)
    theirs = {"output": out.detach(), "hidden_states": leaf.grad, **hf_bert_grads(hf)}
    assert_results_close(ours, theirs, **FP64_TOL)


@pytest.mark.parametrize("attention", ["materialized", "sdpa"])
def test_loads_hf_gpt2_block(attention):
    layer = build("gpt", attention=attention).eval()
    hf = hf_gpt2(layer).eval()
    # the names map one to one, in both modules' state_dict order (docs/layers.md's table)
    assert list(hf.state_dict()) == [theirs for theirs, _ in GPT2_NAMES.values()]
    x = randn((BATCH, SEQ, HIDDEN), seed=100)
    grad = randn((BATCH, SEQ, HIDDEN), seed=101)
    padding = additive_mask()
    ours = run(layer, x, padding, grad)
    # HF's eager attention takes the causal mask from the model: build it as GPT2Model does
    causal = torch.full((SEQ, SEQ), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    leaf = x.clone().requires_grad_()
    out = hf(leaf, attention_mask=padding + causal)
    out = out[0] if isinstance(out, tuple) else out  # transformers 4 returns (hidden,)
    out.backward(grad)
    grads = {name: p.grad for name, p in hf.named_parameters()}
    theirs = {"output": out.detach(), "hidden_states": leaf.grad}
    theirs.update({ours_name: grads[name].T if transposed else grads[name]
                   for ours_name, (name, transposed) in GPT2_NAMES.items()})
    assert_results_close(ours, theirs, **FP64_TOL)


def functional(layer: torch.nn.Module, mask: torch.Tensor | None, seed: int | None):
    """(hidden_states, *params) -> output; reseeds torch's generator before each call when
    `seed` is given, so every dropout mask (drawn from it) is the same in every evaluation."""
    names = [name for name, _ in layer.named_parameters()]

    def call(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if seed is not None:
            torch.manual_seed(seed)
        return torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x, mask))

    return call


GRADCHECK = [("bert", {}), ("bert", {"pre_layer_norm": True, "gelu_checkpoint": True,
                                     "attn_dropout_checkpoint": True,
                                     "normalize_invertible": True}),
             ("gpt", {}), ("gpt", {"attention": "materialized", "gelu_checkpoint": True})]


def assert_gradcheck(kind: str, options: dict, dropout: float, device: torch.device | str,
                     fast: bool) -> None:
    """Finite differences w.r.t. the input and every parameter (random projections for the
    parameters), at tiny sizes; with dropout the generator is reseeded before each evaluation
    (same masks)."""
    layer = build(kind, device=device, dropout=dropout, sizes=(8, 2, 12), **options).train()
    x = randn((1, 3, 8), seed=100, device=device).requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    fn = functional(layer, additive_mask(device, batch=1, seq=3), seed=7 if dropout else None)
    assert torch.autograd.gradcheck(fn, (x, *params), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x: fn(x, *params), (x,), fast_mode=fast)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("case", GRADCHECK, ids=map(case_id, GRADCHECK))
def test_gradcheck(monkeypatch, case, dropout):
    """On the generated torch path: the interpreter is too slow for many evaluations."""
    generated_torch_path(monkeypatch)
    kind, options = case
    assert_gradcheck(kind, options, dropout, "cpu", fast=False)


def test_gradcheck_triton_kernels(monkeypatch):
    """The Triton kernels (interpreted without a GPU), every option and dropout at once."""
    device = select_path(monkeypatch, "triton")
    kind, options = GRADCHECK[1]
    assert_gradcheck(kind, options, 0.2, device, fast=True)


def assert_dropout_reproducible(kind: str, options: dict, device: torch.device | str = "cpu",
                                sizes: tuple[int, int, int] = (HIDDEN, HEADS, INTER),
                                batch: int = BATCH, seq: int = SEQ) -> None:
    """Training with dropout: a fixed torch seed gives bitwise the same step, another seed
    another one, and the checkpointed options (which recompute the dropout in the backward)
    give exactly what the plain layer gives."""
    x = randn((batch, seq, sizes[0]), seed=100, device=device)
    grad = randn((batch, seq, sizes[0]), seed=101, device=device)
    mask = additive_mask(device, batch=batch, seq=seq)

    def step(seed: int, layer_options: dict = options) -> dict[str, torch.Tensor]:
        layer = build(kind, device=device, dropout=0.3, sizes=sizes, **layer_options).train()
        torch.manual_seed(seed)
        return run(layer, x, mask, grad)

    first = step(5)
    assert_results_close(step(5), first, rtol=0, atol=0)
    assert not torch.equal(step(6)["output"], first["output"]), "dropout draws from the seed"
    with torch.no_grad():
        evaluated = build(kind, device=device, dropout=0.3, sizes=sizes, **options).eval()
        assert not torch.equal(evaluated(x, mask), first["output"])
    plain = {k: v for k, v in options.items() if not k.endswith("checkpoint")}
    if plain != options:
        assert_results_close(step(5, plain), first, rtol=0, atol=0)


@pytest.mark.parametrize("case", PARAMS, ids=map(case_id, PARAMS))
def test_dropout_is_seeded_and_recomputed_alike(case):
    kind, options = case
    assert_dropout_reproducible(kind, options)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_compiles_without_graph_breaks(monkeypatch, kind):
    """torch.compile(fullgraph=True) traces the whole layer, checkpoint regions included (the
    generated ops are torch.library ops under compile)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    options = {"attention": "materialized", "gelu_checkpoint": True,
               "attn_dropout_checkpoint": True, "normalize_invertible": True}
    layer = build(kind, **options)
    x = randn((BATCH, SEQ, HIDDEN), seed=100)
    grad = randn((BATCH, SEQ, HIDDEN), seed=101)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    traced = {name.removeprefix("_orig_mod."): value
              for name, value in run(compiled, x, additive_mask(), grad).items()}
    assert_results_close(traced, run(layer, x, additive_mask(), grad), **FP64_TOL)


def test_layer_modules_reach_every_helper():
    """Each helper a block spec may call resolves, in the emitted module, to a runtime function."""
    for module in (bert_layer, gpt_layer):
        missing = []
        for helper in HELPERS:
            found = module
            for part in helper.name.split("."):
                found = getattr(found, part, None)
            if not callable(found):
                missing.append(helper.name)
        assert not missing, f"{module.__name__} lacks {missing}"


def test_state_dict_and_repr():
    layer = BertLayer(HIDDEN, HEADS, INTER, pre_layer_norm=True)
    assert list(layer.state_dict()) == [  # DeepSpeedTransformerLayer's keys, in its order
        "attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w",
        "inter_b", "output_w", "output_b", "norm_w", "norm_b"]
    assert repr(layer) == "BertLayer(hidden_size=16, num_heads=2, intermediate_size=32, " \
                          "pre_layer_norm=True)"
    assert layer.attn_qkvw.shape == (3 * HIDDEN, HIDDEN) and layer.inter_w.shape == (INTER, HIDDEN)
    assert torch.equal(layer.norm_w, torch.ones(HIDDEN)) and torch.equal(layer.inter_b,
                                                                         torch.zeros(INTER))
    assert 0.015 < layer.inter_w.std().item() < 0.025  # initializer_range=0.02
    gpt = GPTLayer(HIDDEN, HEADS, INTER, device="meta", dtype=torch.bfloat16)
    assert list(gpt.state_dict()) == list(GPT2_NAMES)
    assert gpt.mlp_fc_weight.dtype == torch.bfloat16 and gpt.mlp_fc_weight.device.type == "meta"


CONSTRUCTOR_ERRORS = [
    (lambda: BertLayer(15, 2, 32), ("num_heads must divide hidden_size", "hidden_size=15")),
    (lambda: BertLayer(0, 2, 32), ("'hidden_size'", "> 0", "got 0")),
    (lambda: BertLayer(16.0, 2, 32), ("'hidden_size'", "int", "float")),
    (lambda: BertLayer(16, 2, 32, attn_dropout_ratio=1.0), ("'attn_dropout_ratio'", "[0, 1)")),
    (lambda: BertLayer(16, 2, 32, layer_norm_eps=0), ("'layer_norm_eps'", "> 0")),
    (lambda: GPTLayer(16, 2, 32, attention="flash"), ("'attention'", "'sdpa'", "'flash'")),
    (lambda: BertLayer(16, 2, 32, gelu_checkpoint=1), ("'gelu_checkpoint'", "bool", "int")),
    (lambda: GPTLayer(16, 2, 32, attn_dropout_checkpoint=True),
     ("attn_dropout_checkpoint needs attention='materialized'", "attention='sdpa'")),
]


@pytest.mark.parametrize("index", range(len(CONSTRUCTOR_ERRORS)))
def test_bad_options_are_rejected(index):
    make, words = CONSTRUCTOR_ERRORS[index]
    with pytest.raises(BAD_INPUT) as info:
        make()
    missing = [w for w in words if w not in str(info.value)]
    assert not missing, f"error message {str(info.value)!r} does not name {missing}"


FORWARD_ERRORS = [
    (lambda x: x[..., :8], None, ("'hidden_states'", "hidden_size=16", "[2, 5, 8]")),
    (lambda x: x[0], None, ("'hidden_states'", "(batch, seq, hidden_size=16)", "[5, 16]")),
    (lambda x: x.long(), None, ("'hidden_states'", "float64", "torch.int64")),
    (lambda x: x, torch.zeros(BATCH, SEQ, dtype=torch.float64),
     ("'attention_mask'", "[2, 2, 5, 5]", "[2, 5]")),
    (lambda x: x, torch.zeros(3, 1, 1, SEQ, dtype=torch.float64),
     ("'attention_mask'", "[2, 2, 5, 5]", "[3, 1, 1, 5]")),
    (lambda x: x, torch.zeros(BATCH, 1, 1, SEQ, dtype=torch.long),
     ("'attention_mask'", "bool", "torch.float64", "torch.int64")),
    (lambda x: x, torch.zeros(BATCH, 1, 1, SEQ, dtype=torch.float32),
     ("'attention_mask'", "dtype of 'hidden_states' (torch.float64", "got torch.float32")),
]


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("index", range(len(FORWARD_ERRORS)))
def test_bad_input_is_rejected(kind, index):
    change, mask, words = FORWARD_ERRORS[index]
    layer = build(kind)
    x = randn((BATCH, SEQ, HIDDEN))
    with pytest.raises(BAD_INPUT) as info:
        layer(change(x), mask)
    message = str(info.value)
    assert f"{type(layer).__name__}.forward()" in message
    missing = [w for w in words if w not in message]
    assert not missing, f"error message {message!r} does not name {missing}"


# On a GPU: bf16 numerics, and a training step of a 4-layer model.


def model_step(layers: list[torch.nn.Module], x: torch.Tensor, mask: torch.Tensor,
               target: torch.Tensor, lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One SGD step of a stack of layers under a squared-error loss: (loss, updated params)."""
    params = [p for layer in layers for p in layer.parameters()]
    hidden = x
    for layer in layers:
        hidden = layer(hidden, mask)
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    loss = (hidden.to(accumulate) - target.to(accumulate)).square().mean()
    optimizer = torch.optim.SGD(params, lr=lr)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach(), [p.detach() for p in params]


def assert_training_step_matches(kind: str, options: dict, device: str,
                                 dtype: torch.dtype) -> None:
    """Ours in `dtype` vs the reference in fp64 (the exact step): every updated parameter and the
    loss within twice the reference's own error in `dtype`, plus a small atol."""
    depth, sizes, batch, seq = 4, (64, 4, 256), 4, 32
    hidden = sizes[0]
    ours = [build(kind, device=device, dtype=torch.float64, sizes=sizes, seed=50 * i, **options)
            for i in range(depth)]
    x = randn((batch, seq, hidden), seed=1, device=device)
    target = randn((batch, seq, hidden), seed=2, device=device)
    mask = additive_mask(device, batch=batch, seq=seq)

    def step(layers: list[torch.nn.Module], step_dtype: torch.dtype):
        layers = [layer.to(step_dtype).train() for layer in layers]
        return model_step(layers, x.to(step_dtype), mask.to(step_dtype), target, lr=0.5)

    exact_loss, exact = step([ReferenceLayer.like(layer) for layer in ours], torch.float64)
    torch_loss, torch_params = step([ReferenceLayer.like(layer) for layer in ours], dtype)
    our_loss, our_params = step(ours, dtype)
    atol = {torch.bfloat16: 1e-3, torch.float32: 1e-6}[dtype]
    names = [f"layer {i}.{name}" for i, layer in enumerate(ours) for name, _ in
             layer.named_parameters()]
    for name, got, base, ref in zip(["loss", *names], [our_loss, *our_params],
                                    [torch_loss, *torch_params], [exact_loss, *exact],
                                    strict=True):
        err = (got.double() - ref).abs().max().item()
        torch_err = (base.double() - ref).abs().max().item()
        assert err <= 2 * torch_err + atol, (
            f"{name} in {dtype}: max abs error {err:.3g} > 2 * torch's {torch_err:.3g} + {atol:g}")


TRAINING = [("bert", {}), ("bert", {"pre_layer_norm": True, "attention": "sdpa"}),
            ("bert", {"gelu_checkpoint": True, "attn_dropout_checkpoint": True,
                      "normalize_invertible": True}),
            ("gpt", {}), ("gpt", {"attention": "materialized", "gelu_checkpoint": True,
                                  "attn_dropout_checkpoint": True,
                                  "normalize_invertible": True})]


def test_training_step_matches_on_cpu(monkeypatch):
    """The GPU test's harness, in fp32 on the generated torch path (fast, no interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_training_step_matches("bert", {"gelu_checkpoint": True}, "cpu", torch.float32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", TRAINING, ids=map(case_id, TRAINING))
def test_training_step_matches_on_gpu(case, dtype):
    kind, options = case
    assert_training_step_matches(kind, options, "cuda", dtype)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", PARAMS, ids=map(case_id, PARAMS))
def test_bf16_layer_on_gpu(case):
    """One layer in bf16: output, input gradient and every parameter gradient within twice the
    reference layer's own bf16 error (against fp64) plus a small atol."""
    kind, options = case
    sizes, batch, seq = (256, 4, 1024), 4, 128
    layer = build(kind, device="cuda", sizes=sizes, **options).train()
    x = randn((batch, seq, sizes[0]), seed=100, device="cuda")
    grad = randn((batch, seq, sizes[0]), seed=101, device="cuda").to(torch.bfloat16)
    mask = additive_mask("cuda", batch=batch, seq=seq)
    exact = run(ReferenceLayer.like(layer), x, mask, grad.double())
    low = {"x": x.to(torch.bfloat16), "mask": mask.to(torch.bfloat16)}
    theirs = run(ReferenceLayer.like(layer).to(torch.bfloat16), low["x"], low["mask"], grad)
    ours = run(layer.to(torch.bfloat16), low["x"], low["mask"], grad)
    rows = batch * seq
    for name, ref in exact.items():
        atol = 1e-3 * (math.sqrt(rows) if ref.dim() < 3 else 1.0)
        err = (ours[name].double() - ref).abs().max().item()
        torch_err = (theirs[name].double() - ref).abs().max().item()
        assert ours[name].dtype == torch.bfloat16, name
        assert err <= 2 * torch_err + atol, (
            f"{name}: max abs error {err:.3g} > 2 * torch's {torch_err:.3g} + {atol:g}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_dropout_is_seeded_and_recomputed_alike_on_gpu(kind):
    """The same on the GPU (fp64; materialised attention, as torch's fused attention backward
    may accumulate in a nondeterministic order)."""
    options = {"attention": "materialized", "gelu_checkpoint": True,
               "attn_dropout_checkpoint": True}
    assert_dropout_reproducible(kind, options, "cuda", sizes=(256, 4, 1024), batch=4, seq=128)
