"""Llama 4's MoE (top-1 sigmoid routing whose score scales the expert's input, plus an ungated shared expert)
against transformers' Llama4TextMoe: outputs and gradients in fp32 (1e-5); and its config check."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama4 import modeling_llama4 as hf_llama4

from tessera.config import ConfigError, model_config
from tessera.model.moe import MoE
from tessera.validate import validate_model

DIM, HIDDEN, E = 32, 16, 4
MOE = {
    "experts": E,
    "top_k": 1,
    "router": "sigmoid",
    "norm_topk": False,
    "ffn_hidden": HIDDEN,
    "shared_experts": 1,
    "shared_ffn_hidden": HIDDEN,
    "scale_input": True,
    "aux_loss_coef": 0.0,
}


def _pair(**moe) -> tuple[torch.nn.Module, MoE]:
    cfg = transformers.Llama4TextConfig(
        hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=E, num_experts_per_tok=1, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = hf_llama4.Llama4TextMoe(cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = MoE(model_config(dim=DIM, n_heads=4, activation="swiglu", moe={**MOE, **moe}))
    with torch.no_grad():
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=-1)  # Llama 4: gate first, then up ("halves")
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        ours.router.weight.copy_(hf.router.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared, name).weight.copy_(getattr(hf.shared_expert, name).weight)
    return hf, ours


def _grads(module: torch.nn.Module, x: torch.Tensor, hf: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = module(x)[0] if hf else module(x)
    out = out.view(x.shape)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    weight = module.router.weight.grad
    return out.detach(), x.grad, weight


def test_outputs_and_grads_equal_transformers():
    hf, ours = _pair()
    x = torch.randn(2, 12, DIM, generator=torch.Generator().manual_seed(1))
    want, want_dx, want_dr = _grads(hf, x, hf=True)
    got, got_dx, got_dr = _grads(ours, x, hf=False)
    assert want.std() > 0.1
    for a, b in ((got, want), (got_dx, want_dx), (got_dr, want_dr)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert torch.allclose(ours.experts.gate_proj.grad, hf.experts.gate_up_proj.grad.chunk(2, -1)[0], atol=1e-5)


def test_weighting_the_output_instead_is_not_llama4():
    """The deliberate break: the same MoE weighting each expert's output (every other family) differs."""
    hf, ours = _pair(scale_input=False)
    x = torch.randn(2, 12, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - hf(x.view(-1, DIM))[0].view(x.shape)).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        ({"experts": 0}, "model.moe.scale_input is a routing option of MoE layers"),
        ({"norm_topk": True}, "would scale every input by 1"),
    ],
)
def test_bad_scale_input_configs_are_one_line(moe, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(model_config(dim=DIM, n_heads=4, moe={**MOE, **moe}))
