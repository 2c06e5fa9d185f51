"""gpt-oss's MoE (biased router, top-k softmax, experts with biases and the clamped SwiGLU) against
transformers' GptOssMLP: outputs and gradients in fp32 (1e-5)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

from tessera.config import model_config
from tessera.model.gpt_oss_experts import BiasedExperts, clamped_swiglu
from tessera.model.moe import MoE

DIM, HIDDEN, E, K = 32, 24, 4, 2


def _pair(limit: float) -> tuple[torch.nn.Module, MoE]:
    cfg = transformers.GptOssConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_local_experts=E,
        num_experts_per_tok=K,
        swiglu_limit=limit,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    hf = hf_gpt_oss.GptOssMLP(cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = MoE(
        model_config(
            dim=DIM,
            n_heads=4,
            moe={
                "experts": E,
                "top_k": K,
                "ffn_hidden": HIDDEN,
                "router_bias": True,
                "expert_biases": True,
                "swiglu_limit": limit,
                "aux_loss_coef": 0.0,
            },
        )
    )
    assert isinstance(ours.experts, BiasedExperts)
    ex, hx = ours.experts, hf.experts
    with torch.no_grad():
        ours.router.weight.copy_(hf.router.weight)
        ours.router.bias.copy_(hf.router.bias)
        ex.gate_proj.copy_(hx.gate_up_proj[..., ::2])  # HF interleaves gate and up columns
        ex.up_proj.copy_(hx.gate_up_proj[..., 1::2])
        ex.gate_bias.copy_(hx.gate_up_proj_bias[..., ::2])
        ex.up_bias.copy_(hx.gate_up_proj_bias[..., 1::2])
        ex.down_proj.copy_(hx.down_proj)
        ex.down_bias.copy_(hx.down_proj_bias)
    return hf, ours


@pytest.mark.parametrize("limit", [7.0, 1.0])
def test_gpt_oss_moe_matches_hf(limit):
    """limit 1.0 clamps many pre-activations: the clamp's gradient (zero beyond it) is compared too."""
    hf, ours = _pair(limit)
    x = torch.randn(2, 10, DIM, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref, out = hf(x)[0], ours(x2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    weight = torch.linspace(-1, 1, DIM)
    (ref * weight).sum().backward()
    (out * weight).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    ex, hx = ours.experts, hf.experts
    pairs = {
        "router.weight": (ours.router.weight.grad, hf.router.weight.grad),
        "router.bias": (ours.router.bias.grad, hf.router.bias.grad),
        "gate": (ex.gate_proj.grad, hx.gate_up_proj.grad[..., ::2]),
        "up": (ex.up_proj.grad, hx.gate_up_proj.grad[..., 1::2]),
        "gate_bias": (ex.gate_bias.grad, hx.gate_up_proj_bias.grad[..., ::2]),
        "up_bias": (ex.up_bias.grad, hx.gate_up_proj_bias.grad[..., 1::2]),
        "down": (ex.down_proj.grad, hx.down_proj.grad),
        "down_bias": (ex.down_bias.grad, hx.down_proj_bias.grad),
    }
    for name, (mine, theirs) in pairs.items():
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=name)


def test_the_clamp_is_gpt_oss_s():
    """gate clamped above only, up on both sides; the +1 on up and the 1.702 sigmoid slope."""
    gate, up = torch.tensor([-9.0, 0.5, 9.0]), torch.tensor([-9.0, 0.5, 9.0])
    want = (up.clamp(-7, 7) + 1) * gate.clamp(max=7) * torch.sigmoid(1.702 * gate.clamp(max=7))
    torch.testing.assert_close(clamped_swiglu(gate, up, 7.0), want)
    assert clamped_swiglu(gate, up, 7.0)[0] != 0  # the gate is not clamped below


def test_gpt_oss_experts_config_rules(tiny_config):
    """Accepted with expert parallelism (its parity: tests/integration/test_sinks_parallel.py, ep2); not with GELU."""
    from tessera.config import ConfigError

    moe = ["model.moe.experts=4", "model.moe.expert_biases=true", "model.moe.swiglu_limit=7"]
    assert tiny_config(*moe, "parallel.ep=2", "parallel.dp_shard=2").parallel.ep == 2
    with pytest.raises(ConfigError, match="gpt-oss's SwiGLU experts"):
        tiny_config(*moe, "model.activation=gelu")
