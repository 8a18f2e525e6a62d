"""benchmarks.families: a class built tiny, patched and compared with itself unpatched in
float64; what it calls exact and what it calls a difference."""

from __future__ import annotations

import torch

from benchmarks import families


def test_a_patched_llama_is_exact_in_float64(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path, as the workers'
    record = families.check("causal", "llama", "LlamaForCausalLM", timeout_s=300)
    assert record["result"] == "exact", record
    # norms, MLPs, residual fusions, rotary and the loss were all swapped
    assert {"LlamaRMSNorm", "LlamaMLP", "LlamaDecoderLayer", "LlamaAttention"} \
        <= set(record["swapped"]), record["swapped"]
    assert record["difference"] <= families.EXACT


def test_float32_is_lifted_to_float64():
    """HF's float32 upcasts (an RMS norm's, rotary frequencies') compute in float64 within."""
    x = torch.ones(3, dtype=torch.float64)
    with families.lifted():
        assert x.to(torch.float32).dtype == torch.float64
        assert x.float().dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert torch.arange(3).float().dtype == torch.float64
    assert x.to(torch.float32).dtype == torch.float32


def test_a_wrong_gradient_is_a_difference():
    loss = torch.tensor(1.0, dtype=torch.float64)
    grads = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64),
             "key_bias": torch.tensor([1e-17, 0.0], dtype=torch.float64)}
    want = (loss, None, grads)
    # rounding of a gradient that is 0 but for rounding is no difference
    same = (loss, None, {**grads, "key_bias": torch.tensor([-3e-17, 1e-17],
                                                           dtype=torch.float64)})
    assert families._compare(want, same)[0] <= families.EXACT
    wrong = (loss, None, {**grads, "w": torch.tensor([1.0, -2.0 + 1e-6], dtype=torch.float64)})
    difference, where = families._compare(want, wrong)
    assert difference > families.EXACT and where == "gradient of w"
    missing = (loss, None, {"w": grads["w"]})
    assert families._compare(want, missing)[1] == "gradient of key_bias in one model only"


def test_a_check_leaves_the_process_as_it_was(monkeypatch):
    import os
    import signal

    import generated.patch  # noqa: F401 - what the check imports first sets torch's own
    # TORCHINDUCTOR_CACHE_DIR once a process: imported here, whatever ran before in this worker

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    environment = dict(os.environ)
    handler = signal.getsignal(signal.SIGALRM)
    families.check("causal", "gpt2", "GPT2LMHeadModel", timeout_s=300)
    assert torch.get_default_dtype() == torch.float32
    assert signal.getsignal(signal.SIGALRM) is handler
    assert dict(os.environ) == environment
