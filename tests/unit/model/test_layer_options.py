"""The per-layer and Gemma/OLMo options against the HF modules they come from, outputs and gradients (fp32, 1e-4):
local/global layers with their own RoPE (Gemma 3), sandwich norms of gain 1 + w, sqrt(dim) embeddings and
final-logit soft-capping (Gemma 3 with final_logit_softcapping), reordered norms (OLMo 3), NoPE layers
(SmolLM3), attention-logit soft-capping (Gemma 2's eager attention)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager

import tessera
from tessera.hf.families import FAMILIES
from tessera.model.attention import AttnContext
from tessera.model.kernels.eager import eager_attend

TOL = 1e-4
V = 61
_SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)
_GEMMA_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
MODELS = {
    "gemma3_text": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            **_SMALL,
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=24,
            rope_parameters=_GEMMA_ROPE,
            final_logit_softcapping=3.0,
        )
    ),
    "olmo3": lambda: transformers.Olmo3ForCausalLM(
        transformers.Olmo3Config(**_SMALL, num_hidden_layers=4, sliding_window=4)
    ),
    "smollm3": lambda: transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**_SMALL, num_hidden_layers=4)),
}


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 and "norm" in name else 0.15 * noise)
    return model


@pytest.mark.parametrize("family", list(MODELS))
def test_gradients_match_hf(family, tmp_path):
    """Loss and every parameter's gradient equal HF's (each tessera weight against the HF weight it maps to)."""
    hf = _randomized(MODELS[family]())
    hf.save_pretrained(tmp_path)
    ours = tessera.load(tmp_path)
    hf.train(), ours.train()
    tokens = torch.randint(1, V, (2, 20), generator=torch.Generator().manual_seed(2))

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))

    want, got = loss(hf(tokens).logits), loss(ours(tokens))
    want.backward(), got.backward()
    assert abs(want.item() - got.item()) <= TOL * max(1.0, abs(want.item()))
    theirs = dict(hf.named_parameters())
    rules = FAMILIES[family].rules(ours.cfg, family)
    checked = 0
    for name, p in ours.named_parameters():
        rule = next(r for r in rules if r.ours == (name,))
        ref = theirs[rule.theirs[0]].grad
        assert (p.grad - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), name
        checked += 1
    assert checked == len(list(ours.parameters()))


def test_attention_softcap_matches_gemma2_eager_attention():
    """The eager kernel's capped scores against HF Gemma 2's eager attention (GQA, causal), outputs and grads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=gen).mul(3).requires_grad_()
    k = torch.randn(2, 2, 12, 8, generator=gen).mul(3).requires_grad_()
    v = torch.randn(2, 2, 12, 8, generator=gen).requires_grad_()
    scale, cap = 8**-0.5, 2.0
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    additive = torch.zeros(12, 12).masked_fill(~causal, float("-inf"))[None, None]
    want, _ = gemma2_eager(module, q, k, v, additive, scaling=scale, softcap=cap)
    layer = types.SimpleNamespace(scale=scale, softcap=cap, sinks=None, weights_observer=None)
    got = eager_attend(layer, q, k, v, AttnContext(mask=causal[None, None]), 0.0).transpose(1, 2)
    assert (got - want).abs().max().item() <= TOL
    grads = torch.autograd.grad((want * torch.arange(8.0)).sum(), (q, k, v))
    ours = torch.autograd.grad((got * torch.arange(8.0)).sum(), (q, k, v))
    for a, b in zip(ours, grads):
        assert (a - b).abs().max().item() <= TOL
    uncapped = eager_attend(
        types.SimpleNamespace(**{**vars(layer), "softcap": 0.0}), q, k, v, AttnContext(mask=causal[None, None]), 0.0
    ).transpose(1, 2)
    assert (uncapped - want).abs().max().item() > 1e-2  # the cap matters at these scores


def test_fused_head_loss_soft_caps_as_the_plain_loss():
    """The fused head + loss of a soft-capped head equals the plain loss of its capped logits (loss and gradients),
    chunk by chunk; without the cap it would not."""
    from tessera.model.softcap import SoftcappedHead
    from tessera.train.loss import FusedHeadLoss, lm_loss

    gen = torch.Generator().manual_seed(0)
    head = SoftcappedHead(16, V, cap=2.0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, 16, generator=gen))
    hidden = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (2, 9), generator=gen)
    want = lm_loss(head(hidden), labels)
    want_grads = torch.autograd.grad(want, (hidden, head.weight))
    got = FusedHeadLoss(labels, None, chunk=4)(hidden, head)
    got_grads = torch.autograd.grad(got, (hidden, head.weight))
    assert abs(got.item() - want.item()) <= 1e-5
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max().item() <= 1e-5
    uncapped = lm_loss(torch.nn.functional.linear(hidden, head.weight), labels)
    assert abs(uncapped.item() - want.item()) > 1e-2
