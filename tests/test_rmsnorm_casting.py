"""rms_norm's casting_mode (Liger-Kernel's LigerRMSNorm): "gemma", the default, in float32 with
one rounding at the end (torch's rms_norm, Hugging Face's GemmaRMSNorm), "llama", x_hat
rounded to the input's dtype before the weight multiplies it (Hugging Face's LlamaRMSNorm),
and "none", every step rounded to the input's dtype (the norm written out in torch ops on a
16-bit tensor), derived by the engine through `Rounded`, whose derivative is 1."""

import pytest
import torch
from reference import FP64_TOL, HAS_CUDA, force_looped, gradcheck, randn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from generated import rmsnorm
from generated.rmsnorm import RMSNorm, rms_norm

OP = rmsnorm  # for the `schedule` fixture
H = 40  # three column blocks of the looped schedule
EPS = 1e-6


def hf_norm(kind, dtype, device, seed=3):
    """A Hugging Face norm of width H in `dtype`, its weight drawn (not HF's init: a weight of
    ones would hide where the product rounds)."""
    module = (LlamaRMSNorm(H, eps=EPS) if kind == "llama" else GemmaRMSNorm(H, eps=EPS))
    module = module.to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(randn((H,), seed=seed) * 0.5 + (1.0 if kind == "llama" else 0.0))
    return module


def truncated(values, dtype):
    """values (fp32) to a 16-bit dtype rounding toward zero, as the Triton interpreter's casts
    do (bf16: the low 16 bits dropped)."""
    assert dtype == torch.bfloat16
    return (values.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)


def interpreted(device):
    return not HAS_CUDA and device.type == "cpu" and __import__("os").environ.get(
        "TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_is_hugging_face_llama_rms_norm(device, schedule, dtype):
    x = (randn((24, H), seed=1, device=device) * 3).to(dtype)
    hf = hf_norm("llama", dtype, device)
    got = rms_norm(x, (H,), hf.weight, EPS, casting_mode="llama")
    plain = rms_norm(x, (H,), hf.weight, EPS)
    if not interpreted(device):
        assert torch.equal(got, hf(x))  # bit for bit
        assert not torch.equal(plain, hf(x))  # the rounding of x_hat shows: the test can fail
    elif dtype == torch.bfloat16:
        # the interpreter's casts round toward zero: HF's steps with that rounding
        h = x.float()
        x_hat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        want = truncated(hf.weight.float() * truncated(x_hat, dtype).float(), dtype)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, hf(x), rtol=2**-6, atol=0)
        assert not torch.equal(got, plain)


def test_llama_module_in_a_model(device):
    # the module as a drop-in of LlamaRMSNorm: its weight loaded from HF's state dict
    hf = hf_norm("llama", torch.bfloat16, device)
    ours = RMSNorm(H, eps=EPS, casting_mode="llama", device=device, dtype=torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    assert ours.extra_repr().endswith("casting_mode='llama'")
    assert "casting_mode" not in RMSNorm(H).extra_repr()
    x = (randn((5, 3, H), seed=2, device=device) * 2).to(torch.bfloat16)
    torch.testing.assert_close(ours(x), rms_norm(x, (H,), ours.weight, EPS,
                                                 casting_mode="llama"), rtol=0, atol=0)
    if not interpreted(device):
        assert torch.equal(ours(x), hf(x))


def test_gemma_is_the_default_and_hugging_face_gemma_rms_norm(device):
    x = (randn((24, H), seed=1, device=device) * 3).to(torch.bfloat16)
    hf = hf_norm("gemma", torch.bfloat16, device)
    got = rms_norm(x, (H,), hf.weight, EPS, weight_offset=1.0, casting_mode="gemma")
    assert torch.equal(got, rms_norm(x, (H,), hf.weight, EPS, weight_offset=1.0))
    if not interpreted(device):
        assert torch.equal(got, hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_modes_agree_for_full_precision_input(device, dtype):
    # rounding to an fp32 or fp64 input's own dtype changes nothing
    x, w = randn((6, H), seed=1, device=device, dtype=dtype), randn((H,), seed=2, device=device,
                                                                      dtype=dtype)
    assert torch.equal(rms_norm(x, (H,), w, casting_mode="llama"), rms_norm(x, (H,), w))


def test_llama_gradients_pass_the_rounding(device, schedule):
    # the derivative of the rounding is 1: d input is the default mode's (the same kernels'
    # arithmetic), d weight the upstream times the rounded x_hat, as torch's autograd takes
    # it through HF's `.to(input_dtype)`
    dtype = torch.bfloat16
    x = (randn((24, H), seed=1, device=device) * 3).to(dtype).requires_grad_()
    w = (randn((H,), seed=2, device=device) * 0.5 + 1).to(dtype).requires_grad_()
    dy = randn((24, H), seed=4, device=device).to(dtype)
    llama = torch.autograd.grad(rms_norm(x, (H,), w, EPS, casting_mode="llama"), (x, w), dy)
    gemma = torch.autograd.grad(rms_norm(x, (H,), w, EPS), (x, w), dy)
    assert torch.equal(llama[0], gemma[0])
    h = x.detach().double()
    x_hat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    rounded = x_hat.to(dtype) if not interpreted(device) else truncated(x_hat.float(), dtype)
    want = (dy.double() * rounded.double()).sum(0)
    torch.testing.assert_close(llama[1].double(), want, rtol=2**-7, atol=1e-2)
    # and not the default's, which multiplies the unrounded x_hat
    assert not torch.equal(llama[1], gemma[1])


@pytest.mark.parametrize("memory", ["default", "invertible"])
def test_llama_gradcheck(device, memory):
    # fp64 finite differences of the derived backward of both memory modes (at fp64 the
    # rounding is exact, and so is its derivative 1)
    gradcheck(lambda x, w: rms_norm(x, (7,), w, 1e-5, casting_mode="llama", memory=memory),
              [randn((3, 7), seed=1, device=device), randn((7,), seed=2, device=device)],
              fast=False)


def test_llama_looped_two_sweeps(device, overrides):
    overrides.enter_context(force_looped(rmsnorm, one_sweep=False))
    x = randn((4, H), seed=1, device=device)
    w = randn((H,), seed=2, device=device)
    torch.testing.assert_close(rms_norm(x, (H,), w, casting_mode="llama"),
                               rms_norm(x, (H,), w), **FP64_TOL)


BAD = {
    "int": (1, TypeError, "argument 'casting_mode' must be a str \\(one of 'gemma', 'llama', "
                          "'none'\\), got int"),
    "none": (None, TypeError, "argument 'casting_mode' must be a str"),
    "unknown": ("Llama", ValueError, "argument 'casting_mode' must be one of 'gemma', 'llama', "
                                     "'none', got 'Llama'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_casting_mode_is_refused(case):
    value, error, match = BAD[case]
    x = randn((2, H))
    with pytest.raises(error, match=f"rms_norm\\(\\): {match}"):
        rms_norm(x, (H,), casting_mode=value)
    with pytest.raises(error, match=f"RMSNorm\\(\\): {match}"):
        RMSNorm(H, casting_mode=value)


@pytest.mark.parametrize("dropout", [False, True], ids=["add", "dropout_add"])
def test_add_rms_norm_takes_the_casting_mode(device, dropout):
    # the fused adds (and their dropout sibling) round as rms_norm of the sum does
    from generated.add_rmsnorm import AddRMSNorm, add_rms_norm

    dtype = torch.bfloat16
    x = (randn((6, H), seed=1, device=device) * 3).to(dtype)
    r = (randn((6, H), seed=2, device=device) * 3).to(dtype)
    w = (randn((H,), seed=3, device=device) * 0.5 + 1).to(dtype)
    options = dict(dropout_p=0.25, seed=11) if dropout else {}
    out, total = add_rms_norm(x, r, (H,), w, EPS, prenorm=True, residual_in_fp32=True,
                              casting_mode="llama", **options)
    if not interpreted(device):
        # the norm of the fp32 sum, x_hat rounded to bfloat16 (the input's dtype)
        h = total.double()
        x_hat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
        assert torch.equal(out, (x_hat.double() * w.double()).to(dtype))
    plain = add_rms_norm(x, r, (H,), w, EPS, **options)
    assert not torch.equal(out, plain)
    module = AddRMSNorm(H, eps=EPS, casting_mode="llama", device=device, dtype=dtype)
    assert "casting_mode='llama'" in module.extra_repr()
    with pytest.raises(ValueError, match="add_rms_norm\\(\\): argument 'casting_mode' must be "
                                         "one of 'gemma', 'llama', 'none', got 'None'"):
        add_rms_norm(x, r, (H,), w, casting_mode="None")
    # "none": every step of the norm of the fp32 sum rounded to bfloat16
    out, total = add_rms_norm(x, r, (H,), w, EPS, prenorm=True, residual_in_fp32=True,
                              casting_mode="none", **options)
    assert_within_an_ulp(out, written_out(total, w, 0.0, EPS, dtype, interpreted(device)))
    assert not torch.equal(out, plain)


def written_out(x, w, offset, eps, dtype, toward_zero=False):
    """An RMS norm written out in torch ops, each step's result rounded to `dtype` (as torch's
    ops on a tensor of that dtype round it: Liger-Kernel's casting_mode="none", its reference
    the norm computed without a cast); the mean accumulated in float32, as torch's mean of a
    16-bit tensor. `toward_zero`: each rounding toward zero, as the Triton interpreter's."""
    def rd(t):
        return (truncated(t, dtype) if toward_zero else t.to(dtype)).float()

    h = x.float()
    mean_square = rd(rd(h * h).mean(-1, keepdim=True))
    rstd = rd(torch.rsqrt(rd(mean_square + eps)))
    y = rd(h * rstd) * rd(offset + w.float())
    return truncated(y, dtype) if toward_zero else y.to(dtype)


def assert_within_an_ulp(got, want):
    """got is want, but where a float32 sum in another order rounds the mean square to the
    neighbouring 16-bit value: then within the rounding that carries through (a few ulps),
    in few elements."""
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=4 * ulp, atol=0)
    assert (got != want).float().mean() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_none_rounds_every_step(device, schedule, dtype, offset):
    x = (randn((24, H), seed=1, device=device) * 3).to(dtype)
    w = (randn((H,), seed=2, device=device) * 0.5 + 1 - offset).to(dtype)
    got = rms_norm(x, (H,), w, EPS, weight_offset=offset, casting_mode="none")
    if not interpreted(device):
        assert_within_an_ulp(got, written_out(x, w, offset, EPS, dtype))
        if offset == 0.0:
            # with a weight of the input's dtype, the norm as torch's ops compute it (whose
            # mean of a 16-bit tensor may round its sum before dividing: a row's mean square
            # can be the neighbouring value)
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
            torch.testing.assert_close(got.float(), (h * w).float(),
                                       rtol=4 * torch.finfo(dtype).eps, atol=0)
    elif dtype == torch.bfloat16:
        assert_within_an_ulp(got, written_out(x, w, offset, EPS, dtype, toward_zero=True))
    for mode in ("gemma", "llama"):
        assert not torch.equal(got, rms_norm(x, (H,), w, EPS, weight_offset=offset,
                                             casting_mode=mode))
    module = RMSNorm(H, eps=EPS, weight_offset=offset, casting_mode="none", device=device,
                     dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    assert module.extra_repr().endswith("casting_mode='none'")
    assert torch.equal(module(x), got)


@pytest.mark.parametrize("memory", ["default", "invertible"])
def test_none_gradients_within_torch_error(device, memory):
    # the gradient of each rounding is 1, and the backward's arithmetic is float32's: against
    # the float64 gradient of the written-out norm, at most twice the error of torch's
    # autograd through the same steps in bfloat16
    dtype = torch.bfloat16
    x = (randn((24, H), seed=1, device=device) * 3).to(dtype).requires_grad_()
    w = (randn((H,), seed=2, device=device) * 0.5 + 1).to(dtype).requires_grad_()
    dy = randn((24, H), seed=4, device=device).to(dtype)
    got = torch.autograd.grad(rms_norm(x, (H,), w, EPS, casting_mode="none", memory=memory),
                              (x, w), dy)

    def steps(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    exact = torch.autograd.grad(steps(x.double(), w.double()), (x, w), dy.double())
    torch_same_dtype = torch.autograd.grad(steps(x, w), (x, w), dy)
    for g, e, t in zip(got, exact, torch_same_dtype, strict=True):
        error = (g.double() - e).abs().max()
        assert error <= 2 * (t.double() - e).abs().max() + 1e-2 * e.abs().max()


@pytest.mark.parametrize("memory", ["default", "invertible"])
def test_none_gradcheck(device, memory):
    # at fp64 every rounding is exact and its derivative 1: the derived backward of the
    # switched-on kernels against finite differences
    gradcheck(lambda x, w: rms_norm(x, (7,), w, 1e-5, casting_mode="none", memory=memory),
              [randn((3, 7), seed=1, device=device), randn((7,), seed=2, device=device)],
              fast=False)


def test_rounded_in_the_spec_language():
    # op.rounded declares an element or a row value; both printers round to the input's dtype
    # and back, and its derivative is 1
    import sympy

    from codegen.printers import TORCH, TRITON, KernelPrinter
    from derive.spec import Kind, OpSpec, Rounded

    op = OpSpec("toy")
    x = op.input("x")
    total = op.row_sum("total", x)
    element = op.rounded("element", 2 * x)
    row = op.rounded("row", total)
    assert op.node("element").kind is Kind.ELEMENT and op.node("row").kind is Kind.ROW
    assert op.node("element").expr == Rounded(2 * x)
    assert sympy.diff(Rounded(x**2), x) == 2 * x
    varies = {"x", "element"}.__contains__
    assert KernelPrinter(TRITON, varies)(Rounded(x) * row) == "row * (x).to(ROUND).to(ACC)"
    assert KernelPrinter(TORCH, varies)(Rounded(x + element)) == "(element + x).to(dtype).to(acc)"


def test_a_choice_is_checked_against_the_spec():
    # a Choice sets scalars declared absent=, its first (default) value giving their absent
    # values: the default call runs the kernels compiled without them
    from derive.api import Choice, NormalizedShapeAPI, api_mismatches
    from derive.spec import OpSpec

    def spec(absent, values):
        op = OpSpec("toy_norm")
        x = op.input("x")
        op.scalar("eps", positive=True)
        switch = op.scalar("switch", absent=absent)
        op.output(op.element("y", x * (1 + switch)))
        op.save(x)
        op.api = NormalizedShapeAPI(
            function="toy_norm", module="ToyNorm", torch_function="toy", torch_module="Toy",
            params=(), eps=None, choices=(Choice("mode", ("switch",), values),))
        return op

    assert api_mismatches(spec(0, (("off", (0.0,)), ("on", (1.0,))))) == []
    assert any("must be declared absent=" in p
               for p in api_mismatches(spec(None, (("off", (0.0,)), ("on", (1.0,))))))
    assert any("must be declared absent=" in p
               for p in api_mismatches(spec(0, (("on", (1.0,)), ("off", (0.0,))))))
    assert any("one number per scalar" in p
               for p in api_mismatches(spec(0, (("off", (0.0, 1.0)),))))
    assert any("distinct strs" in p
               for p in api_mismatches(spec(0, (("off", (0.0,)), ("off", (1.0,))))))
