"""What a user of an installed vjpforge does, run from a directory outside the checkout with the
installed package alone on sys.path: import every shipped module, call every op forward and
backward on the CPU against torch's own, patch a tiny Hugging Face model, and derive a spec of
the user's own (its generated test is run by the caller). Exits non-zero on the first failure.

    python installed.py SPEC OUT    # SPEC: a user spec file; OUT: where `derive` writes
"""

import importlib
import importlib.metadata
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import vjpforge

CHECKOUT_FILES = ("pyproject.toml", ".git")


def installed(module) -> Path:
    """The module's file, which must lie in site-packages, not in a checkout."""
    path = Path(module.__file__).resolve()
    assert "site-packages" in path.parts, f"{module.__name__} imported from {path}"
    for parent in path.parents:
        assert not any((parent / name).exists() for name in CHECKOUT_FILES), \
            f"{module.__name__} imported from a checkout: {path}"
    return path


def close(got, want, name, atol=1e-5, rtol=1e-4):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                               msg=lambda message: f"{name}: {message}")


def forward_backward(name, ours, theirs, *inputs):
    """ours(*inputs) and theirs(*inputs) agree, and so do the gradients of every input."""
    grads = []
    for function in (ours, theirs):
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = function(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        (out * weight).sum().backward()
        grads.append((out.detach(), [x.grad for x in leaves if x.requires_grad]))
    (out, dx), (ref, rdx) = grads
    close(out, ref, name)
    for index, (g, r) in enumerate(zip(dx, rdx, strict=True)):
        close(g, r, f"{name}: gradient of input {index}")
    return name


def ops() -> list[str]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    rows, n, vocab = 6, 32, 24
    x, r, w, b = randn(rows, n), randn(rows, n), randn(n), randn(n)
    target = torch.randint(0, vocab, (rows,), generator=g)
    half = n // 2
    cos, sin = randn(rows, n), randn(rows, n)

    def rotate(t):
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    def rms(t, weight):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + torch.finfo(t.dtype).eps) \
            * weight

    checked = [
        forward_backward("layer_norm", lambda t, w_, b_: vjpforge.layer_norm(t, (n,), w_, b_),
                         lambda t, w_, b_: F.layer_norm(t, (n,), w_, b_), x, w, b),
        forward_backward("rms_norm", lambda t, w_: vjpforge.rms_norm(t, (n,), w_),
                         lambda t, w_: F.rms_norm(t, (n,), w_), x, w),
        forward_backward("add_layer_norm",
                         lambda t, s, w_: vjpforge.add_layer_norm(t, s, (n,), w_),
                         lambda t, s, w_: F.layer_norm(t + s, (n,), w_), x, r, w),
        forward_backward("add_rms_norm", lambda t, s, w_: vjpforge.add_rms_norm(t, s, (n,), w_),
                         lambda t, s, w_: rms(t + s, w_), x, r, w),
        forward_backward("dropout_add_layer_norm",
                         lambda t, s: vjpforge.dropout_add_layer_norm(t, s, (n,), dropout_p=0.0),
                         lambda t, s: F.layer_norm(t + s, (n,)), x, r),
        forward_backward("dropout_add_rms_norm",
                         lambda t, s: vjpforge.dropout_add_rms_norm(t, s, (n,), dropout_p=0.0),
                         lambda t, s: rms(t + s, 1.0), x, r),
        forward_backward("softmax", lambda t: vjpforge.softmax(t, dim=-1),
                         lambda t: torch.softmax(t, dim=-1), x),
        forward_backward("masked_softmax",
                         lambda t: vjpforge.masked_softmax(t, causal=True, training=False),
                         lambda t: torch.softmax(t.masked_fill(
                             torch.ones(rows, n, dtype=torch.bool).triu(1), float("-inf")), -1),
                         x),
        forward_backward("gelu", lambda t: vjpforge.gelu(t), F.gelu, x),
        forward_backward("gelu_tanh", lambda t: vjpforge.gelu_tanh(t),
                         lambda t: F.gelu(t, approximate="tanh"), x),
        forward_backward("geglu", vjpforge.geglu, lambda a, u: F.gelu(a) * u, x, r),
        forward_backward("geglu_tanh", vjpforge.geglu_tanh,
                         lambda a, u: F.gelu(a, approximate="tanh") * u, x, r),
        forward_backward("swiglu", vjpforge.swiglu, lambda a, u: F.silu(a) * u, x, r),
        forward_backward("bias_dropout_add",
                         lambda t, s, b_: vjpforge.bias_dropout_add(t, s, bias=b_, p=0.0),
                         lambda t, s, b_: t + b_ + s, x, r, b),
        forward_backward("rotary", lambda t: vjpforge.rotary(t, cos, sin),
                         lambda t: t * cos + rotate(t) * sin, x),
        forward_backward("cross_entropy", lambda t: vjpforge.cross_entropy(t, target),
                         lambda t: F.cross_entropy(t, target), randn(rows, vocab)),
        forward_backward("linear_cross_entropy",
                         lambda h, m: vjpforge.linear_cross_entropy(h, m, target),
                         lambda h, m: F.cross_entropy(h @ m.T, target), x, randn(vocab, n)),
    ]
    for layer in (vjpforge.BertLayer(n, 2, 2 * n, 0.0, 0.0).double(),
                  vjpforge.GPTLayer(n, 2, 2 * n, 0.0, 0.0).double()):
        out = layer(randn(2, 3, n))
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
        checked.append(type(layer).__name__)
    return checked


def patched_model() -> dict:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                      vocab_size=64, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    original = transformers.LlamaForCausalLM(config).double()
    patched = transformers.LlamaForCausalLM(config).double()
    patched.load_state_dict(original.state_dict())
    report = vjpforge.patch_model(patched, loss=True)
    assert report.swapped, f"patch_model swapped nothing: {report.skipped}"
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (original, patched):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.detach())
    # LlamaRMSNorm and the rotary tables compute in float32 even in a float64 model, so the two
    # agree to float32's rounding, not float64's
    close(losses[1], losses[0], "patched Llama loss", atol=1e-7, rtol=1e-6)
    for (name, p), q in zip(original.named_parameters(), patched.parameters(), strict=True):
        close(q.grad, p.grad, f"patched Llama: gradient of {name}", atol=1e-7, rtol=1e-5)
    return dict(report)


def main(spec: Path, out: Path) -> None:
    for name in ("vjpforge", "generated", "codegen", "derive"):
        installed(importlib.import_module(name))
    assert vjpforge.__version__ == importlib.metadata.version("vjpforge"), vjpforge.__version__
    import generated

    shipped = sorted(m.name for m in pkgutil.iter_modules(generated.__path__))
    for name in shipped:
        installed(importlib.import_module(f"generated.{name}"))
    missing = [n for n in vjpforge.__all__ if not hasattr(vjpforge, n)]
    assert not missing, f"vjpforge.__all__ names what it lacks: {missing}"
    path = "Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "torch path"
    print(f"installed: {len(shipped)} modules import; ops on the {path}: {', '.join(ops())}")
    print(f"installed: patch_model on a tiny Llama, loss and gradients as unpatched: "
          f"{patched_model()}")
    # the shipped tree cannot be regenerated into site-packages: a clear refusal
    derive = str(Path(sys.executable).with_name("derive"))  # the installed command
    refused = subprocess.run([derive, "--check"], capture_output=True, text=True)
    assert refused.returncode == 2 and "installed copy" in refused.stderr, refused
    written = subprocess.run([derive, str(spec), "--out", str(out)], capture_output=True,
                             text=True)
    assert written.returncode == 0, written.stdout + written.stderr
    print(f"installed: {written.stdout.strip()}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
