"""HF interop: each family imported from a random-weight HF model reproduces its logits (fp32, 1e-4)
and greedy generations, and exports back to a checkpoint ``from_pretrained`` reads identically.

The vocabularies are small (99 ids, as in many test checkpoints): a model that brings its own
tokenizer may have any vocabulary size.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tessera
from tessera.config import MoEConfig, model_config
from tessera.model import build_model, generate, generate_seq2seq
from tessera.hf.weights import HFConversionError, save_hf

from helpers.runs import run_cli

TOL = 1e-4
V = 99  # vocabulary of the tiny HF models: below SentencePiece's byte-fallback minimum on purpose
_LLAMA_LIKE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def _llama(**kw) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_LLAMA_LIKE, **kw}))


def _t5(proj: str) -> transformers.PreTrainedModel:
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=V,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            feed_forward_proj=proj,
        )
    )


def _jamba() -> transformers.PreTrainedModel:
    cfg = transformers.JambaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    return transformers.JambaForCausalLM(cfg)


def _qwen3_next(**kw) -> transformers.PreTrainedModel:
    """Gated DeltaNet layers 0-2, gated attention in layer 3 (HF's default 3:1 interval), partial rotary."""
    cfg = transformers.Qwen3NextConfig(
        **{**_LLAMA_LIKE, "num_hidden_layers": 4},
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        **kw,
    )
    return transformers.Qwen3NextForCausalLM(cfg)


def _qwen3_5(moe: bool = False, **kw) -> transformers.PreTrainedModel:
    """Qwen3.5's text model: Qwen3-Next's layout with four separate Gated DeltaNet input projections; the MoE model
    renormalizes its top-k in every layer. rope_parameters carry the multimodal sections, as released configs do."""
    shape = {k: v for k, v in _LLAMA_LIKE.items() if k != "intermediate_size" or not moe}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}
    args = dict(
        **{**shape, "num_hidden_layers": 4},
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        rope_parameters={**rope, "mrope_interleaved": True},
        **kw,
    )
    if moe:
        moe_args = dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
        )
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**args, **moe_args))
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**args))


def _nemotron_h(**kw) -> transformers.PreTrainedModel:
    """Mamba-2 + MLP, a Mamba-2 layer alone, attention + MLP, Mamba-2 + MLP (7 HF layers, 4 tessera layers)."""
    types = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]
    cfg = transformers.NemotronHConfig(
        vocab_size=V,
        hidden_size=32,
        layers_block_type=types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=8,
        max_position_embeddings=128,
        **kw,
    )
    return transformers.NemotronHForCausalLM(cfg)


def _deepseek(**kw) -> transformers.PreTrainedModel:
    """Latent attention in every layer; dense FFNs unless first_k_dense_replace says otherwise."""
    kw = {"first_k_dense_replace": 2, **kw}
    cfg = transformers.DeepseekV3Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=128,
        **kw,
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


def _kimi_linear() -> transformers.PreTrainedModel:
    """Kimi Delta Attention in layers 0, 1 and 3, NoPE latent attention in layer 2; a dense FFN in layer 0, then
    group-limited sigmoid MoE with a shared expert."""
    cfg = transformers.KimiLinearConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        linear_num_heads=2,
        linear_head_dim=8,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.KimiLinearForCausalLM(cfg)


def _deepseek_v32() -> transformers.PreTrainedModel:
    """DeepSeek Sparse Attention: each query attends to the 8 keys (of up to 28) its lightning indexer picks."""
    cfg = transformers.DeepseekV32Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        index_topk=8,
        index_n_heads=4,
        index_head_dim=16,
        max_position_embeddings=128,
        **_DEEPSEEK_MOE,
    )
    return transformers.DeepseekV32ForCausalLM(cfg)


def _gemma3(**kw) -> transformers.PreTrainedModel:
    """Gemma 3's shape: 5 local layers (4-token windows, RoPE base 1e4) to 1 global (1e6, linear x8), sandwich norms,
    a query_pre_attn_scalar unlike head_dim."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = transformers.Gemma3TextConfig(
        **{**_LLAMA_LIKE, "num_hidden_layers": 6},
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        rope_parameters=rope,
        **kw,
    )
    return transformers.Gemma3ForCausalLM(cfg)


def _gpt_oss() -> transformers.PreTrainedModel:
    """gpt-oss: a 4-token window then full attention, sinks, biased clamped experts, YaRN with truncate=false
    (at head_dim 16 the kept fraction changes the frequencies: tests/unit/hf/test_gpt_oss.py)."""
    cfg = transformers.GptOssConfig(
        **{**_LLAMA_LIKE, "intermediate_size": 16},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
    )
    return transformers.GptOssForCausalLM(cfg)


_SCOUT_ROPE = {**_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 16.0, "high_freq_factor": 1.0}  # no blended band


def _llama4(**kw) -> transformers.PreTrainedModel:
    """Llama 4 text: layer 3 NoPE (global, temperature-tuned from position 3 on), the others RoPE (llama3 scaling)
    in 8-token chunks with the QK L2 norm; 20 greedy tokens from 8 cross three chunk boundaries."""
    cfg = transformers.Llama4TextConfig(
        **{**_LLAMA_LIKE, "num_hidden_layers": 4, "intermediate_size": 16},
        intermediate_size_mlp=48,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.5,
        **{"rope_parameters": _SCOUT_ROPE, **kw},
    )
    return transformers.Llama4ForCausalLM(cfg)


_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# DeepSeek-V3 routing: sigmoid scores, 2 groups of which the best 1 is searched, scaled weights, a shared expert
_DEEPSEEK_MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
)
# Issue 13's router options (sigmoid, groups, shared gate, first dense layers): the families that need them wait for them.
_MOE_OPTIONS = hasattr(MoEConfig(), "shared_gate") and hasattr(MoEConfig(), "groups")
_NEEDS_MOE_OPTIONS = {"qwen2_moe", "deepseek_v3_moe"}


HF_MODELS = {
    "llama": lambda: _llama(),
    "llama_yarn": lambda: _llama(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "llama_linear": lambda: _llama(
        rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}, tie_word_embeddings=True
    ),
    # head_dim 16: one RoPE wavelength (19.9) falls between original/high (8) and original/low (32), the smoothed band
    "llama3": lambda: _llama(head_dim=16, rope_parameters=_LLAMA3_ROPE),
    "llama_bias": lambda: _llama(attention_bias=True, mlp_bias=True),
    "llama_mlp_bias": lambda: _llama(mlp_bias=True),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=8)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_LLAMA_LIKE)),
    # layer 0 full attention, layer 1 a 4-token window
    "qwen2_layers": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_LLAMA_LIKE, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**_LLAMA_LIKE, **_MOE, router_jitter_noise=0.1)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2
        )
    ),
    "gpt2_layer_scale": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128, scale_attn_by_inverse_layer_idx=True
        )
    ),
    "bert": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
        )
    ),
    "t5": lambda: _t5("relu"),
    "t5_gated": lambda: _t5("gated-gelu"),
    "mamba": lambda: transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8)
    ),
    "mamba2": lambda: transformers.Mamba2ForCausalLM(
        transformers.Mamba2Config(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            state_size=8,
            num_heads=4,
            head_dim=16,
            n_groups=2,
            chunk_size=8,
        )
    ),
    "jamba": _jamba,
    "qwen3_next": lambda: _qwen3_next(num_experts=0),
    "qwen3_next_moe": lambda: _qwen3_next(**_QWEN_MOE, shared_expert_intermediate_size=24, decoder_sparse_step=2),
    "qwen3_5": _qwen3_5,
    "qwen3_5_tied": lambda: _qwen3_5(tie_word_embeddings=True),
    "qwen3_5_moe": lambda: _qwen3_5(moe=True),
    "nemotron_h": _nemotron_h,
    "nemotron_h_bias": lambda: _nemotron_h(mlp_bias=True, use_bias=True),
    "deepseek_v3": lambda: _deepseek(rope_interleave=True, q_lora_rank=16),
    "deepseek_v3_plain_rope": lambda: _deepseek(rope_interleave=False, q_lora_rank=None),
    # DeepSeek's YaRN: mscale = mscale_all_dim (cos/sin magnitude 1) and the softmax scale times mscale(40)^2
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**_LLAMA_LIKE, **_QWEN_MOE, norm_topk_prob=True, head_dim=16)
    ),
    "qwen3_moe_sparse_step": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**_LLAMA_LIKE, **_QWEN_MOE, decoder_sparse_step=2)
    ),
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, eos_token_id=1)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(**_LLAMA_LIKE, **_QWEN_MOE, shared_expert_intermediate_size=24)
    ),
    "deepseek_v3_moe": lambda: _deepseek(q_lora_rank=16, **_DEEPSEEK_MOE),
    "deepseek_v32": _deepseek_v32,
    "kimi_linear": _kimi_linear,
    "gemma3": _gemma3,
    "gemma3_softcap": lambda: _gemma3(final_logit_softcapping=3.0, tie_word_embeddings=False),
    # 3 sliding layers (4-token windows) to 1 full; norms after each sublayer; QK-norm over all heads
    "olmo3": lambda: transformers.Olmo3ForCausalLM(
        transformers.Olmo3Config(**{**_LLAMA_LIKE, "num_hidden_layers": 4}, sliding_window=4)
    ),
    # layer 3 without rotary (NoPE)
    "smollm3": lambda: transformers.SmolLM3ForCausalLM(
        transformers.SmolLM3Config(**{**_LLAMA_LIKE, "num_hidden_layers": 4}, pad_token_id=0)
    ),
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,  # Scout's layout: MoE in every layer
    "llama4_maverick": lambda: _llama4(
        interleave_moe_layer_step=2, use_qk_norm=False, attention_bias=True, rope_parameters=_LLAMA3_ROPE
    ),
    "deepseek_v3_yarn": lambda: _deepseek(
        q_lora_rank=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}


# Families an exported config cannot be told apart from by its numbers (Qwen3.5's text model is Qwen3-Next's):
# the export names them.
_EXPORT_AS = {"qwen3_5": "qwen3_5_text", "qwen3_5_tied": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that logits differ clearly between tokens (HF's init is nearly flat); SSM decays
    (A_log) and time steps spread so that the state carries information across many positions."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = p.ndim == 1 and any(s in name.lower() for s in ("norm", "ln_"))
            if name.endswith("A_log"):
                p.copy_(2 * torch.rand(p.shape, generator=gen))
            elif name.endswith(("dt_bias", "dt_proj.bias")):
                p.copy_(noise - 2)
            else:
                p.copy_(1 + 0.1 * noise if is_norm and name.endswith("weight") else 0.15 * noise)
    return model.eval()


def _logits(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        if hasattr(model, "decoder") and (hf and model.config.is_encoder_decoder or not hf):
            return model(input_ids=x, decoder_input_ids=y).logits if hf else model(x, y)
        return model(x).logits if hf else model(x)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(4, V, (2, 24), generator=torch.Generator().manual_seed(2))
    y = torch.randint(4, V, (2, 12), generator=torch.Generator().manual_seed(3))
    return x, y


def _auto(family: str) -> type:
    if family == "bert":
        return transformers.AutoModelForMaskedLM
    return transformers.AutoModelForSeq2SeqLM if family.startswith("t5") else transformers.AutoModelForCausalLM


def _check_generation(family: str, hf: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor) -> None:
    if family.startswith("t5"):
        hf.generation_config.update(eos_token_id=None, decoder_start_token_id=0)
        want = hf.generate(x, max_new_tokens=20, do_sample=False, use_cache=False)[:, 1:]
        assert torch.equal(generate_seq2seq(model, x, 20, start_id=0), want)
    elif family != "bert":
        hf.generation_config.eos_token_id = None
        want = hf.generate(x[:, :8], max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)[:, 8:]
        assert torch.equal(generate(model, x[:, :8], 20, temperature=0), want)


@pytest.mark.parametrize("family", list(HF_MODELS))
def test_hf_parity_and_roundtrip(family, tmp_path):
    if family in _NEEDS_MOE_OPTIONS and not _MOE_OPTIONS:
        pytest.skip("needs issue 13's MoE router options (model.moe.shared_gate, groups, first_dense)")
    torch.manual_seed(0)
    hf = _randomize(HF_MODELS[family](), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    model = tessera.load(tmp_path / "hf")
    assert not model.training
    x, y = _inputs()
    ref = _logits(hf, x, y, hf=True)
    diff = (_logits(model, x, y, hf=False) - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logits diff| {diff:.2e}"
    assert ref.std() > 0.1  # the comparison is not between near-constant logits
    _check_generation(family, hf, model, x)

    save_hf(model, tmp_path / "out", _EXPORT_AS.get(family))
    back = _auto(family).from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    assert (_logits(back, x, y, hf=True) - ref).abs().max().item() <= TOL


def test_qwen3_next_recipe_exports_to_the_published_size():
    """The full-size recipe's exported config builds (on meta) an HF model with as many parameters as ours."""
    from pathlib import Path

    from tessera.hf.weights import export_config
    from tessera.model import count_parameters
    from tessera.validate import load_config

    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "qwen3-next-80b-a3b.toml")
    hf_config, family = export_config(config.model)
    assert family == "qwen3_next"
    with torch.device("meta"):
        hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hf_config))
        ours = build_model(config.model)
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(ours) == 79_674_391_296


@pytest.mark.parametrize(
    "recipe, family, count",
    [
        ("qwen3.5-27b", "qwen3_5_text", 26_895_998_464),
        ("qwen3.5-35b-a3b", "qwen3_5_moe_text", 34_660_610_688),
        ("nemotron-h-8b", "nemotron_h", 8_100_852_736),
    ],
)
def test_hybrid_recipes_export_to_the_published_models(recipe, family, count):
    """The full-size recipes export to the released configs' shapes: HF's model of the exported config (on meta)
    counts what the released config gives (Qwen3.5-27B's and Qwen3.5-35B-A3B's text_config, Nemotron-H-8B) and
    what tessera builds; Nemotron-H's 28 tessera blocks are its 52 HF layers."""
    from pathlib import Path

    from tessera.hf.weights import export_config
    from tessera.model import count_parameters
    from tessera.validate import load_config

    config = load_config(Path(__file__).resolve().parents[3] / "configs" / f"{recipe}.toml")
    hf_config, _ = export_config(config.model, family)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
        ours = build_model(config.model)
    assert type(hf).__name__ == transformers.AutoConfig.for_model(**hf_config).architectures[0]
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(ours) == count


def test_qwen3_5_released_multimodal_checkpoint_imports_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration directory (as released: text_config, model.language_model.* weights, a
    vision tower): tessera reads the text model, whose logits equal the multimodal model's on text (1e-4); export
    names the text family instead of writing a model without its vision tower."""
    text = _qwen3_5().config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)
    tokens = dict(image_token_id=95, video_token_id=96, vision_start_token_id=97, vision_end_token_id=98)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens)
    hf = _randomize(transformers.Qwen3_5ForConditionalGeneration(cfg), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    model = tessera.load(tmp_path / "hf")
    x = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        assert (model(x) - ref).abs().max().item() <= TOL and ref.std() > 0.1
    with pytest.raises(HFConversionError, match="qwen3_5_text"):
        save_hf(model, tmp_path / "out", "qwen3_5")
    # imported and exported without naming a family: the text model comes back as Qwen3.5, not as Qwen3-Next
    from tessera.hf.convert import hf_export, hf_import

    hf_import(tmp_path / "hf", tmp_path / "run")
    assert hf_export(tmp_path / "run", tmp_path / "out") == "qwen3_5_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Qwen3_5ForCausalLM
    with torch.no_grad():
        assert (back(x).logits - ref).abs().max().item() <= TOL


def test_untied_t5_from_a_transformers_4_checkpoint(tmp_path):
    """A T5 v1.1-style checkpoint (own lm_head, tie_word_embeddings false, so no output scaling) imports and exports."""
    hf = _randomize(_t5("gated-gelu"), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    head = 0.1 * torch.randn(V, 32, generator=torch.Generator().manual_seed(7))
    save_file({**tensors, "lm_head.weight": head}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("scale_decoder_outputs", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model = tessera.load(tmp_path / "hf")
    assert not model.cfg.tie_embeddings and not model.cfg.output_dim_scale
    x, y = _inputs()
    with torch.no_grad():
        hidden = hf(input_ids=x, decoder_input_ids=y, output_hidden_states=True).decoder_hidden_states[-1]
        want = hidden @ head.T  # the decoder output (after its final norm) through the untied head, unscaled
        assert (model(x, y) - want).abs().max().item() <= TOL
    save_hf(model, tmp_path / "out")
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(back.lm_head.weight, head)
    assert (_logits(back, x, y, hf=True) - want).abs().max().item() <= TOL


def test_mixtral_router_jitter_matches_in_training(tmp_path):
    """In training mode the MoE input is jittered exactly as HF does (same RNG draws), in eval not at all."""
    hf = _randomize(HF_MODELS["mixtral"](), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    model = tessera.load(tmp_path / "hf")
    assert model.cfg.moe.jitter == pytest.approx(0.1)
    x, _ = _inputs()
    hf.train()
    model.train()
    torch.manual_seed(5)
    want = hf(x).logits
    torch.manual_seed(5)
    got = model(x)
    assert (got - want).abs().max().item() <= TOL
    assert (got - model.eval()(x)).abs().max().item() > 1e-3  # the jitter does something


def _as_transformers_4(config: dict) -> dict:
    """The config as transformers 4.x reads it: RoPE from top-level ``rope_theta`` and ``rope_scaling``
    (``type`` renamed ``rope_type``), ``rope_parameters`` unknown; sliding layers from ``layer_types``."""
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    scaling = dict(old.get("rope_scaling") or {})
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    old["rope_theta"] = old.get("rope_theta", 10000.0)
    old["rope_scaling"] = scaling or None
    return old


@pytest.mark.parametrize("family", ["llama_yarn", "llama_linear", "llama3", "qwen2_layers", "t5"])
def test_export_reads_the_same_with_transformers_4_rules(family, tmp_path):
    hf = _randomize(HF_MODELS[family](), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    save_hf(tessera.load(tmp_path / "hf"), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    old = _as_transformers_4(config)
    if "rope_parameters" in config:  # both forms carry the same RoPE
        assert old["rope_theta"] == config["rope_parameters"]["rope_theta"]
        assert {"rope_theta": old["rope_theta"], "rope_type": "default", **(old["rope_scaling"] or {})} == config[
            "rope_parameters"
        ]
    (tmp_path / "out" / "config.json").write_text(json.dumps(old))
    back = _auto(family).from_pretrained(tmp_path / "out").eval()  # transformers 5 on the 4.x keys alone
    x, y = _inputs()
    assert (_logits(back, x, y, hf=True) - _logits(hf, x, y, hf=True)).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["qwen2", "llama4"])
def test_cli_import_export_small_vocab(family, tmp_path):
    hf = _randomize(HF_MODELS[family](), seed=4)
    hf.save_pretrained(tmp_path / "hf")
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    res = run_cli("convert", "hf-export", str(tmp_path / "run"), str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    exported = {"llama4": "llama4_text"}.get(family, family)
    assert exported in res.stdout
    x = torch.randint(0, V, (1, 16))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() <= TOL
        assert (tessera.load(tmp_path / "run")(x) - hf(x).logits).abs().max().item() <= TOL
    assert f"Imported from the HF {exported} checkpoint" in (tmp_path / "out" / "README.md").read_text()


def test_cli_unsupported_option_is_a_clear_error(tmp_path):
    _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}).save_pretrained(
        tmp_path / "hf"
    )
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 2
    assert "rope_type" in res.stderr and "dynamic" in res.stderr and "Traceback" not in res.stderr


def test_cli_qwen3_next_state_dims_that_disagree_are_one_line(tmp_path):
    """A Qwen3-Next config whose value heads do not split evenly over its key heads: exit 2, one line."""
    _qwen3_next(num_experts=0).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "linear_num_value_heads": 3}))
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 2
    assert "linear_num_value_heads" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "make, field, value",
    [
        (_nemotron_h, "n_groups", 3),  # 8 Mamba heads do not split into 3 B/C groups
        (_qwen3_5, "layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
    ],
)
def test_cli_hybrid_state_dims_that_disagree_are_one_line(make, field, value, tmp_path):
    """An HF config whose state dimensions or layer types tessera cannot build: exit 2, one line naming the field."""
    make().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, field: value}))
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 2
    assert field in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "family, change, field",
    [
        ("nemotron_h", {"mamba_head_dim": 10}, "mamba_num_heads"),  # 8 x 10 is no multiple of hidden_size 32
        ("nemotron_h", {"layers_block_type": ["linear_attention", "moe"]}, "layers_block_type[1]"),
        ("nemotron_h", {"layers_block_type": ["full_attention", "linear_attention"]}, "layers_block_type[0]"),
        ("nemotron_h", {"layers_block_type": ["mlp", "linear_attention"]}, "layers_block_type[0]"),
        ("nemotron_h", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ("qwen3_5", {"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ("qwen3_5", {"attn_output_gate": False}, "attn_output_gate"),
    ],
)
def test_hybrid_configs_tessera_cannot_build_name_the_field(family, change, field):
    """Each refused option raises one HFConversionError naming the HF field (the CLI prints it, exit 2)."""
    from tessera.hf.weights import config_from_hf

    hf = HF_MODELS[family]().config.to_dict()
    with pytest.raises(HFConversionError, match=re.escape(field)):
        config_from_hf({**hf, **change})


def test_nemotron_h_layer_orders_in_every_form_pair_the_same():
    """Released configs give the order as hybrid_override_pattern (M * - E), older ones with legacy type names:
    all read as the same tessera blocks."""
    from tessera.hf.weights import config_from_hf

    hf = HF_MODELS["nemotron_h"]().config.to_dict()
    types = hf.pop("layers_block_type")
    legacy = [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t) for t in types]
    want, _ = config_from_hf({**hf, "layers_block_type": types})
    assert want.layer_pattern == "MmAM" and want.n_layers == 4
    assert config_from_hf({**hf, "hybrid_override_pattern": "M-M*-M-"})[0] == want
    assert config_from_hf({**hf, "layers_block_type": legacy})[0] == want


def test_unsupported_family(tmp_path):
    _llama().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    with pytest.raises(HFConversionError, match="falcon"):
        tessera.load(tmp_path / "hf")


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(attention="performer"), "model.attention"),
        (dict(position="alibi"), "model.position"),
        (dict(qk_norm=True), "model.attention.qk_norm"),
        (dict(rotary_fraction=0.5), "model.position.rotary_fraction"),
        (dict(norm_position="post"), "model.norm_position"),
        (dict(rope_scaling="ntk", rope_scaling_factor=2.0), "ntk"),
        (dict(qkv_bias=True, ffn_bias=True), "model.attention.o_bias"),  # Llama's attention_bias covers o_proj too
        (dict(n_layers=4, layer_pattern="MMAA"), "model.layer_pattern"),  # Jamba spaces attention periodically
    ],
)
def test_export_refuses_what_hf_cannot_express(overrides, key, tmp_path):
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
    model = build_model(model_config(**{**base, **overrides}))
    with pytest.raises(HFConversionError, match=key):
        save_hf(model, tmp_path / "out")


def test_t5_export_refuses_scaling_that_transformers_4_cannot_read(tmp_path):
    cfg = model_config(
        arch="encoder_decoder",
        vocab_size=V,
        dim=32,
        n_layers=1,
        n_heads=4,
        position="t5_bias",
        norm="rmsnorm",
        activation="relu",
        tie_embeddings=False,
        output_dim_scale=True,
    )
    with pytest.raises(HFConversionError, match="output_dim_scale"):
        save_hf(build_model(cfg), tmp_path / "out")


def test_small_vocabularies_are_refused_only_where_a_tokenizer_is_trained(tmp_path):
    from tessera.validate import validate_model
    from tessera.data.sources import DataError, Document
    from tessera.data.tokenizer import train_tokenizer

    validate_model(model_config(vocab_size=V, dim=32, n_layers=1, n_heads=4))  # a model may have any vocabulary
    with pytest.raises(DataError, match="at least 260"):
        train_tokenizer([Document("d", "def f(x):\n    return x\n")], "tiny", V, tmp_path)


# Kimi-Linear-48B-A3B's config.json (moonshotai/Kimi-Linear-48B-A3B-Instruct): the values that decide the size.
_KIMI_LINEAR_48B = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}


def test_kimi_linear_recipe_is_the_published_config_and_size():
    """The published config imports to the full-size recipe's model, and the recipe's exported config builds (on
    meta) an HF model with as many parameters as ours."""
    from pathlib import Path

    from tessera.hf.weights import config_from_hf, export_config
    from tessera.model import count_parameters
    from tessera.validate import load_config

    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "kimi-linear-48b-a3b.toml")
    imported, _ = config_from_hf(dict(_KIMI_LINEAR_48B))
    for key in ("layer_pattern", "kda", "mla", "dim", "n_heads", "ffn_hidden", "vocab_size", "position"):
        assert getattr(imported, key) == getattr(config.model, key), key
    assert (imported.moe.experts, imported.moe.top_k, imported.moe.ffn_hidden) == (256, 8, 1024)
    hf_config, family = export_config(config.model)
    assert family == "kimi_linear"
    with torch.device("meta"):
        hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**hf_config))
        published = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**_KIMI_LINEAR_48B))
        ours = build_model(config.model)
    counts = [sum(p.numel() for p in m.parameters()) for m in (hf, published)]
    assert counts == [count_parameters(ours)] * 2 == [49_122_675_072] * 2


@pytest.mark.parametrize("key, value", [("linear_head_dim", 16), ("linear_num_heads", 0)])
def test_cli_kimi_linear_state_dims_that_disagree_are_one_line(tmp_path, key, value):
    """A Kimi Linear config whose KDA state dims disagree with its weights (head_dim 16 over weights of 8) or are
    impossible (no heads): exit 2, one line naming the key or the tensor."""
    _kimi_linear().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, key: value}))
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 2
    assert (key if value == 0 else "kda.") in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
