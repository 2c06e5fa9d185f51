"""DeepSeek Sparse Attention: the layer equals transformers' DeepseekV32Attention (indexer top-k, outputs and
gradients, fp32), the sparse core equals masked dense attention, cached decoding equals the full forward, and the
indexer's KL term trains the indexer only (warm-up: dense attention, the rest frozen)."""

from __future__ import annotations

import pytest
import torch

from tessera.config import model_config
from tessera.hf.families.deepseek import _deinterleave
from tessera.model import build_model
from tessera.model.dsa import SparseLatentAttention, freeze_for_indexer_warmup

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402

MLA = {"kv_rank": 16, "q_rank": 16, "rope_head_dim": 8, "nope_head_dim": 8, "v_head_dim": 12}
T = 24


def _ours(topk: int, stage: str = "sparse") -> torch.nn.Module:
    torch.manual_seed(0)
    dsa = {"topk": topk, "index_heads": 4, "index_head_dim": 16, "stage": stage}
    cfg = model_config(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=64, norm_eps=1e-6, mla=MLA, dsa=dsa)
    return build_model(cfg)


def _hf(topk: int) -> torch.nn.Module:
    config = hf_v32.DeepseekV32Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        index_topk=topk,
        index_head_dim=16,
        index_n_heads=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "sdpa"
    return hf_v32.DeepseekV32Attention(config, 0), hf_v32.DeepseekV32RotaryEmbedding(config)


def _load_hf_weights(ours: SparseLatentAttention, hf: torch.nn.Module) -> None:
    """HF's MLA rotates interleaved pairs: de-interleave its RoPE rows (as the deepseek import does)."""
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    qk = MLA["nope_head_dim"] + MLA["rope_head_dim"]
    q = state["q_b_proj.weight"]
    state["q_b_proj.weight"] = q[_deinterleave(q.shape[0], qk, MLA["nope_head_dim"])]
    kv = state["kv_a_proj_with_mqa.weight"]
    state["kv_a_proj_with_mqa.weight"] = kv[_deinterleave(kv.shape[0], kv.shape[0], MLA["kv_rank"])]
    ours.load_state_dict(state)


def _pair(topk: int):
    model = _ours(topk).eval()
    ours = model.layers["0"].attention
    assert isinstance(ours, SparseLatentAttention)
    hf, rotary = _hf(topk)
    torch.manual_seed(3)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    _load_hf_weights(ours, hf)
    return model, ours, hf, rotary


@pytest.mark.parametrize("topk", [6, 64])  # sparse (each query keeps 6 of up to 24 keys), and every key
def test_layer_matches_hf_deepseek_v32_attention_outputs_and_grads(topk):
    model, ours, hf, rotary = _pair(topk)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1))
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    pos = torch.arange(T)[None]
    cos_sin = rotary(x, pos)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(2, 1, T, T)
    want, _ = hf(x_hf, cos_sin, causal, position_ids=pos)
    got = ours(x_ours, model.context(2, T, 0, None, None, x.device))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-5, rtol=1e-4)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if name.startswith("indexer."):
            assert p.grad is None, f"{name}: the LM loss must not reach the indexer"
            continue
        want_grad = hf_params[name].grad
        if name in ("q_b_proj.weight", "kv_a_proj_with_mqa.weight"):
            _load = {"q_b_proj.weight": (16, 8), "kv_a_proj_with_mqa.weight": (24, 16)}[name]
            want_grad = want_grad[_deinterleave(want_grad.shape[0], *_load)]
        torch.testing.assert_close(p.grad, want_grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_indexer_picks_hf_top_k():
    model, ours, hf, rotary = _pair(6)
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(2, T, T)
    q_resid = hf.q_a_layernorm(hf.q_a_proj(x))
    want = hf.indexer(x, q_resid, rotary(x, pos), causal, pos).long()
    ctx = model.context(2, T, 0, None, None, x.device)
    iq, iw = ours.indexer.queries(x, q_resid, ctx)
    got, valid = ours.indexer.select(iq, iw, ours.indexer.keys(x, ctx), causal, 6)
    # the same set per query (rows with fewer than 6 allowed keys pad with masked ones: compare the allowed)
    for b in range(2):
        for t in range(T):
            assert set(got[b, t][valid[b, t]].tolist()) == {i for i in want[b, t].tolist() if i <= t}, (b, t)


def test_cached_decoding_equals_full_forward():
    model = _ours(5).eval()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        caches = model.new_caches(2, 16)
        steps = [model(x[:, :7], caches, 0)] + [model(x[:, i : i + 1], caches, i) for i in range(7, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_sparse_stage_trains_the_indexer_through_its_kl_only():
    model = _ours(5).train()
    attention = model.layers["0"].attention
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(x).logsumexp(-1).mean().backward()
    kl = attention.last_indexer_loss
    assert kl is not None and kl > 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(grads[n].abs().sum() > 0 for n in grads if ".indexer." in n)
    # Without the KL term the main model's gradients are the same: it reaches the indexer only.
    model.zero_grad()
    attention.loss_coef = 0.0
    model(x).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad.abs().sum() == 0, name
        else:
            torch.testing.assert_close(p.grad, grads[name], msg=lambda m: f"{name}: {m}")


def test_warmup_is_dense_and_trains_only_the_indexer():
    model = _ours(3, stage="warmup").train()
    dense = _ours(0).train()  # plain MLA: same seed, same weights for the shared parameters
    dense.load_state_dict(model.state_dict(), strict=False)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x), dense(x))  # warm-up attention is dense
    freeze_for_indexer_warmup(model)
    model(x).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".indexer." in name), name
    assert model.layers["0"].attention.last_indexer_loss > 0
