"""rotary (RoPE) against Hugging Face's formula q * cos + rotate_half(q) * sin: the exact VJP
derived through the partner read, on both paths (the Triton kernels, under the interpreter
without a GPU, and the torch path), for grouped-query shapes, broadcast and strided tables
and inputs, low precision, and the calls the op refuses."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from reference import FP64_TOL, assert_low_precision_ok, gradcheck, randn

import generated.rotary as rotary
from codegen.runtime import launch

OP = rotary  # the conftest's schedule fixture forces it looped
B, S = 2, 5


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb, as written there."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def tables(width: int, device, seed: int = 10, dtype=torch.float64):
    """cos and sin of (batch, seq, head_dim) as Hugging Face's rotary embedding makes them
    (each half the same frequencies), at random positions."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.rand(B, S, 1, generator=generator, dtype=torch.float64) * 50
    inv_freq = 1.0 / 10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width)
    angles = torch.cat([positions * inv_freq] * 2, dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def qk(width: int, device, heads=(4, 2)):
    return (randn((B, heads[0], S, width), seed=1, device=device),
            randn((B, heads[1], S, width), seed=2, device=device))


def assert_vjp_exact(q, k, cos, sin, **kwargs):
    """Outputs and the gradients of q and k those of autograd through HF's formula (fp64)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
    mine = rotary.apply_rotary_pos_emb(*leaves, cos, sin, **kwargs)
    theirs_leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
    theirs = hf_apply(*theirs_leaves, cos, sin, **kwargs)
    upstream = [randn(t.shape, seed=20 + i, device=t.device) for i, t in enumerate(theirs)]
    for got, want in zip(mine, theirs, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        # torch's arithmetic keeps a permuted q's layout (attention's (B, S, H, D) buffer):
        # so must the op, or the attention output is copied before its projection
        if q.stride(-1) == 1 and k.stride(-1) == 1:
            assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, **FP64_TOL)
    # one node of autograd's graph for q and k together (`launch.each`), right over them: the
    # rows are views the op takes inside, which autograd does not record
    node = mine[0].grad_fn
    assert mine[1].grad_fn is node
    reached = [f.variable for f, _ in node.next_functions if hasattr(f, "variable")]
    assert len(reached) == 2 and all(r is leaf for r, leaf in zip(reached, leaves, strict=True))
    grads = torch.autograd.grad(mine, leaves, upstream)
    wanted = torch.autograd.grad(theirs, theirs_leaves, upstream)
    for got, want in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got, want, **FP64_TOL)


@pytest.mark.parametrize("width", [8, 64])
def test_matches_hf_and_its_exact_vjp(device, schedule, width):
    # GQA: 4 query heads, 2 key heads; 64 columns: several blocks of a looped row
    assert_vjp_exact(*qk(width, device), *tables(width, device))


def test_gradcheck_through_the_function(device):
    cos, sin = tables(6, device)
    q, k = qk(6, device, heads=(2, 1))
    gradcheck(lambda a, b: torch.cat([t.flatten() for t in
                                      rotary.apply_rotary_pos_emb(a, b, cos, sin)]),
              [q, k], fast=False)


def test_q_and_k_share_one_node_and_its_double_backward(device):
    """apply_rotary_pos_emb's q and k take one node of autograd's graph (`launch.each`); with
    one of them not needing a gradient, the other takes a node of its own; the node's
    backward is differentiable again (create_graph) as each op's own."""
    cos, sin = tables(6, device)
    q, k = (t.requires_grad_() for t in qk(6, device, heads=(2, 1)))
    torch.autograd.gradgradcheck(
        lambda a, b: torch.cat([t.flatten() for t in
                                rotary.apply_rotary_pos_emb(a, b, cos, sin)]), [q, k])
    q_embed, k_embed = rotary.apply_rotary_pos_emb(q, k.detach(), cos, sin)
    assert k_embed.grad_fn is None and q_embed.grad_fn is not None
    assert q_embed.grad_fn.next_functions[0][0].variable is q
    want = hf_apply(q, k, cos, sin)
    torch.testing.assert_close(q_embed, want[0], **FP64_TOL)
    torch.testing.assert_close(k_embed, want[1], **FP64_TOL)


def test_the_q_and_k_node_frees_its_tables_without_the_garbage_collector(device):
    """The node of `launch.each` holds its calls' saved tensors as autograd's own (freed with
    the graph), in no reference cycle that only the garbage collector would break: the step's
    tables die with their last reference."""
    cos, sin = tables(6, device)
    q, k = (t.requires_grad_() for t in qk(6, device))
    # Triton's interpreter keeps a launch's arguments in closures of its own, which only the
    # collector frees: there the node's own parts are what is checked
    interpreted = launch.use_triton(q) and os.environ.get("TRITON_INTERPRET") == "1"
    gc.collect()
    gc.disable()
    try:
        for backward in (False, True):
            cos_, sin_ = cos.clone(), sin.clone()
            alive = weakref.ref(cos_.untyped_storage())
            outputs = rotary.apply_rotary_pos_emb(q, k, cos_, sin_)
            parts = outputs[0].grad_fn.parts
            assert len(parts) == 2 and all(p.saved == () and p.ctx is None for p in parts)
            if backward:
                sum(t.sum() for t in outputs).backward()
            del cos_, sin_, outputs
            assert alive() is None or interpreted
    finally:
        gc.enable()


def test_a_call_that_raises_inside_each_keeps_nothing(device):
    """An op call that raises inside `launch.each` leaves no kept call behind: the next call
    applies its Function as ever."""
    cos, sin = tables(6, device)
    q, k = (t.requires_grad_() for t in qk(6, device))
    with pytest.raises(TypeError, match="argument 'k' must be a torch.Tensor"):
        rotary.apply_rotary_pos_emb(q, None, cos, sin)
    with pytest.raises(ValueError):
        # the first call is kept, the second raises
        launch.each(lambda: rotary.rotary(q, cos[:, None], sin[:, None]),
                    lambda: rotary.rotary(k, cos[..., :4], sin[..., :4]))
    assert getattr(launch._EACH, "calls", None) is None
    out = rotary.rotary(q, cos[:, None], sin[:, None])
    assert type(out.grad_fn).__name__ == "_FunctionBackward"


def test_gradcheck_of_arbitrary_tables(device):
    # the derived VJP reads sin at the partner column: not the same as at j once the halves
    # of the table differ (HF's never do), which random tables show
    cos, sin = (randn((1, 1, 8), seed=s, device=device) for s in (3, 4))
    gradcheck(lambda x: rotary.rotary(x, cos, sin), [randn((3, 2, 8), seed=5, device=device)],
              fast=False)
    assert_vjp_exact(*qk(8, device), cos[0].expand(B, S, 8), sin[0].expand(B, S, 8))


def test_stride_zero_and_strided_inputs(device):
    width = 16
    cos, sin = tables(width, device)
    # tables expanded over the batch (stride 0), q and k transposed views of (B, S, H, D)
    expanded = [t[:1].expand(B, S, width) for t in (cos, sin)]
    assert expanded[0].stride(0) == 0
    q = randn((B, S, 4, width), seed=1, device=device).transpose(1, 2)
    k = randn((B, S, 2, 2 * width), seed=2, device=device)[..., ::2].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    assert_vjp_exact(q, k, *expanded)
    # (B, S, H, D) layout: the tables unsqueezed at dim 2
    assert_vjp_exact(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)


def test_dtype_promotion_as_torch(device):
    cos, sin = tables(8, device, dtype=torch.float32)
    q, k = (t.to(torch.bfloat16) for t in qk(8, device))
    mine = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    theirs = hf_apply(q, k, cos, sin)
    for got, want in zip(mine, theirs, strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(device, dtype):
    width = 32
    cos, sin = tables(width, device, dtype=dtype)

    def ours(x):
        return rotary.rotary(x, cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype))

    def theirs(x):
        c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        return x * c + rotate_half(x) * s

    assert_low_precision_ok(ours, theirs, [randn((B, 4, S, width), seed=1, device=device) * 3],
                            dtype)


def test_double_backward(device):
    cos, sin = tables(8, device)
    q = randn((B, 2, S, 8), seed=1, device=device).requires_grad_()
    k = randn((B, 1, S, 8), seed=2, device=device).requires_grad_()
    torch.autograd.gradgradcheck(lambda a, b: rotary.apply_rotary_pos_emb(a, b, cos, sin),
                                 (q, k))


def test_odd_width_is_refused(device):
    q, k = qk(8, device)
    cos, sin = tables(8, device)
    with pytest.raises(ValueError, match=r"apply_rotary_pos_emb\(\): argument 'k' must have "
                                         r"an even last dim .*got 7"):
        rotary.apply_rotary_pos_emb(q, k[..., :7], cos, sin)
    with pytest.raises(ValueError, match=r"rotary\(\): argument 'input' must have an even "
                                         r"last dim .*got 5"):
        rotary.rotary(q[..., :5], cos[..., :5].unsqueeze(1), sin[..., :5].unsqueeze(1))


def test_tables_that_require_grad_are_refused(device):
    q, k = qk(8, device)
    cos, sin = tables(8, device)
    with pytest.raises(ValueError, match="argument 'sin' is not differentiated here and must "
                                         "not require grad"):
        rotary.apply_rotary_pos_emb(q, k, cos, sin.clone().requires_grad_())


def test_tables_must_broadcast(device):
    q, k = qk(8, device)
    cos, sin = tables(8, device)
    with pytest.raises(ValueError, match="argument 'cos' must be broadcastable"):
        rotary.apply_rotary_pos_emb(q, k, cos[..., :4], sin)
    with pytest.raises(TypeError, match="argument 'sin' must be a torch.Tensor"):
        rotary.apply_rotary_pos_emb(q, k, cos, None)


#: a spec reading a per-column parameter at the partner column too, and one absent there
COLUMN_PARTNER_SPEC = '''
import sympy

from derive.api import ElementwiseAPI
from derive.spec import N, OpSpec


def spec():
    op = OpSpec("scaled_rotation", doc="tanh(x * w + sign(j) * x_p * w_p * v)")
    x = op.input("x")
    w = op.column_param("w")
    v = op.column_param("v", absent=1)
    j = op.column_index("j")
    sign = sympy.Piecewise((-1, j < N / 2), (1, True))
    y = op.element("y", sympy.tanh(x * w + sign * op.partner("xp", x) * op.partner("wp", w) * v))
    op.output(y)
    op.save(x)
    op.api = ElementwiseAPI(function="scaled_rotation", module="ScaledRotation",
                            torch_function="-", call_params=("w", "v"))
    return op
'''


@pytest.fixture(scope="module")
def column_partner(tmp_path_factory):
    import importlib.util

    from codegen.driver.command import main

    out = tmp_path_factory.mktemp("column_partner")
    (out / "spec.py").write_text(COLUMN_PARTNER_SPEC)
    assert main([str(out / "spec.py"), "--out", str(out)]) == 0
    spec = importlib.util.spec_from_file_location("scaled_rotation", out / "scaled_rotation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.scaled_rotation


def test_partner_reads_of_column_parameters(column_partner, device):
    """The engine's rule, not rotary's: a column parameter read at the partner column, in the
    partner read's adjoint (v at p(j)) and in the forward (w at p(j)), absent or given."""
    def theirs(x, w, v):
        half = x.shape[-1] // 2
        sign = torch.where(torch.arange(x.shape[-1], device=x.device) < half, -1.0, 1.0)
        v = 1.0 if v is None else v
        return torch.tanh(x * w + sign * x.roll(half, -1) * w.roll(half, -1) * v)

    x, w, v = (randn(shape, seed=s, device=device) for s, shape in
               ((1, (3, 8)), (2, (8,)), (3, (8,))))
    for given in (v, None):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
        ours = column_partner(leaves[0], w=leaves[1], v=given)
        reference = [t.detach().clone().requires_grad_() for t in (x, w)]
        wanted = theirs(*reference, given)
        torch.testing.assert_close(ours, wanted, **FP64_TOL)
        for got, want in zip(torch.autograd.grad(ours.sum(), leaves),
                             torch.autograd.grad(wanted.sum(), reference), strict=True):
            torch.testing.assert_close(got, want, **FP64_TOL)
    gradcheck(lambda a, b, c: column_partner(a, w=b, v=c), [x, w, v], fast=False)
