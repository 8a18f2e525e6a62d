"""Where a route of `patch_model` keeps the model's own code: below the crossover its op
measured (`own_below`), where the op it calls would run torch's expression of itself anyway
(the fused residual add + norm), and as `VJPFORGE_DISPATCH` and `Dispatch.override` say."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers
from reference import select_path

import generated.add_layernorm as add_layernorm
import generated.cross_entropy as cross_entropy
from benchmarks import crossover
from codegen.runtime import dispatch
from generated.patch import patch_model

#: what keeps_own reads of a CUDA tensor (no GPU needed to test the rule)
CUDA = SimpleNamespace(is_cuda=True)


@pytest.fixture
def measured(monkeypatch):
    """Each op's measurements decide (tests/conftest.py forces the kernels)."""
    monkeypatch.setattr(dispatch, "FORCED", None)


@pytest.fixture
def device(monkeypatch):
    """Where the kernels run: the GPU, else the CPU through Triton's interpreter."""
    return select_path(monkeypatch, "triton")


def test_a_cuda_call_keeps_its_own_code_below_the_routes_crossover(measured):
    route = dispatch.Dispatch("op", own_below=100)
    assert dispatch.keeps_own(CUDA, 99, route)
    assert not dispatch.keeps_own(CUDA, 100, route)
    assert not dispatch.keeps_own(CUDA, 0, None)  # nothing measured: the route
    assert not dispatch.keeps_own(CUDA, 0, dispatch.Dispatch("op"))
    with route.override("kernels"):
        assert not dispatch.keeps_own(CUDA, 99, route)
    with route.override("torch"):
        assert dispatch.keeps_own(CUDA, 10**9, route)
    with dispatch.forcing("kernels"):
        assert not dispatch.keeps_own(CUDA, 99, route)
    with dispatch.forcing("torch"):
        assert dispatch.keeps_own(CUDA, 10**9, route)
    assert "own_below=100" in repr(route)


def test_every_op_module_states_its_routes_measurements():
    assert dispatch.of(cross_entropy.linear_cross_entropy) is cross_entropy.DISPATCH
    assert dispatch.of(add_layernorm.add_layer_norm) is add_layernorm.DISPATCH
    assert dispatch.of(len) is None


def _gpt2(device, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                     n_positions=32, resid_pdrop=dropout, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).to(device).train()


def _tokens(device):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)


def _counting(monkeypatch, owner, name):
    calls = []
    function = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(name) or function(*a, **k))
    return calls


@pytest.mark.parametrize("memory", [None, "invertible"])
def test_a_fused_layer_runs_its_own_forward_where_its_op_would_run_torchs(
        measured, device, monkeypatch, memory):
    """Where add_layer_norm would run torch's expression (the layer's own computation), the
    layer's own forward runs and spares the rewritten forward's host time; in a memory mode
    torch's expression has not, the fusion runs."""
    model = _gpt2(device)
    patched = copy.deepcopy(model)
    report = patch_model(patched, memory=memory)
    assert "GPT2Block" in report.counts, report
    tokens = _tokens(device)
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block
    calls = _counting(monkeypatch, block, "forward")
    with add_layernorm.DISPATCH.override("torch"):
        loss = patched(input_ids=tokens, labels=tokens).loss
    assert len(calls) == (2 if memory is None else 0), calls
    torch.testing.assert_close(loss, model(input_ids=tokens, labels=tokens).loss)
    calls.clear()
    with add_layernorm.DISPATCH.override("kernels"):
        patched(input_ids=tokens, labels=tokens)
    assert calls == [], "the layer's own forward ran"


def test_the_loss_route_keeps_the_models_loss_where_its_op_says(measured, device):
    model = _gpt2(device)
    patched = copy.deepcopy(model)
    report = patch_model(patched, loss=True, include=["loss"])
    assert "ForCausalLMLoss" in report.counts, report
    tokens = _tokens(device)
    # routed: the logits never exist whole
    with cross_entropy.DISPATCH.override(own_below=0):
        assert patched(input_ids=tokens, labels=tokens).logits is None
    with cross_entropy.DISPATCH.override("torch"):
        output = patched(input_ids=tokens, labels=tokens)
    assert output.logits is not None
    torch.testing.assert_close(output.loss, model(input_ids=tokens, labels=tokens).loss)
    # below the route's crossover, a CUDA call computes the model's own loss (a CPU call under
    # the interpreter runs the kernels: no crossover is measured there)
    with cross_entropy.DISPATCH.override(own_below=10**18):
        output = patched(input_ids=tokens, labels=tokens)
    assert (output.logits is not None) == (device.type == "cuda")


def _route_row(rows, ours, own, ours_peak=1, own_peak=1):
    return {"op": "a", "rows": rows, "cols": 2, "vocab": 5, "ours_us": ours, "own_us": own,
            "ours_peak": ours_peak, "own_peak": own_peak}


def test_own_below_is_where_the_route_is_faster_and_no_larger_from_then_on():
    rows = [_route_row(1, 300, 100), _route_row(10, 90, 100), _route_row(100, 80, 100)]
    assert crossover.choose(rows) == {"a": {"own_below": 10 * 2 * 5}}
    # faster at 10 rows but larger there: from 100 rows
    rows[1] = _route_row(10, 90, 100, ours_peak=2)
    assert crossover.choose(rows) == {"a": {"own_below": 100 * 2 * 5}}
    # never faster: past every size measured
    assert crossover.choose([_route_row(1, 300, 100)]) == {"a": {"own_below": 11}}


def test_routes_smoke():
    rows = crossover.main(["--routes", "--cpu-smoke"])
    assert {(row["rows"], row["cols"], row["vocab"]) for row in rows} == {(4, 64, 256),
                                                                          (16, 64, 256)}
    assert all(row["ours_us"] > 0 and row["own_us"] > 0 for row in rows)
