"""The rules of the [model] keys read together: what the zoo can build, checked before anything is built.

``validate_model`` also checks model configs that come from elsewhere (an HF checkpoint, a pruned
model); ``tessera.validate.validate`` runs it first for every job.
"""

from __future__ import annotations

from tessera.config import JobConfig, ModelConfig, MoEConfig
from tessera.config.checks import require, require_all, require_finite


def validate_model(m: ModelConfig) -> None:
    """The [model] checks alone (also for configs that come from elsewhere, e.g. an HF checkpoint)."""
    require_finite("model", m)
    require_all("model", m, ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"), positive=True)
    require_all(
        "model",
        m,
        (
            "n_kv_heads",
            "n_decoder_layers",
            "head_dim",
            "type_vocab_size",
            "sentinel_tokens",
            "ffn_hidden",
            "ffn_multiplier",
        ),
        positive=False,
    )
    require(
        m.head_dim > 0 or m.dim % m.n_heads == 0,
        f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; pick a dim that is a multiple of n_heads "
        "or set model.head_dim",
    )
    kv = m.n_kv_heads or m.n_heads
    require(
        m.n_heads % kv == 0,
        f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={kv}; use a divisor of n_heads",
    )
    require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")
    require(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    require(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    require(0.0 < m.mask_prob < 1.0, f"model.mask_prob must be in (0, 1), got {m.mask_prob}")
    require(m.mean_span_length >= 1.0, f"model.mean_span_length must be >= 1, got {m.mean_span_length}")
    require(m.mtp_depth >= 0, f"model.mtp_depth must be >= 0, got {m.mtp_depth}")
    require(
        not m.mtp_depth or m.arch == "decoder",
        f"model.mtp_depth (multi-token prediction) is for decoders, not model.arch='{m.arch}'",
    )
    _validate_attention(m)
    _validate_heads_per_layer(m)
    _validate_position(m)
    _validate_moe(m.moe)
    _validate_mixers(m)


def _validate_attention(m: ModelConfig) -> None:
    a = m.attention
    require_all("model.attention", a, ("sliding_window", "global_tokens", "scale"), positive=False)
    require_all("model.attention", a, ("block_size", "random_blocks", "performer_features"), positive=True)
    require(0.0 <= a.dropout < 1.0, f"model.attention.dropout must be in [0, 1), got {a.dropout}")
    linear = a.kernel in ("linear", "performer")
    require(
        not linear or m.position.kind in ("rope", "learned", "sinusoidal", "none"),
        f"model.attention.kernel='{a.kernel}' cannot add a score bias; model.position.kind='{m.position.kind}' needs "
        "a softmax kernel (sdpa or eager)",
    )
    require(
        not linear or a.sliding_window == 0,
        f"model.attention.sliding_window needs a softmax kernel, not model.attention.kernel='{a.kernel}'",
    )
    require(
        a.kernel != "longformer" or a.sliding_window > 0,
        "model.attention.kernel='longformer' needs model.attention.sliding_window > 0 (the local width)",
    )


def _validate_heads_per_layer(m: ModelConfig) -> None:
    """Per-layer head counts: whole GQA groups of the standard attention of a decoder or encoder."""
    spec = m.attention.heads_per_layer
    if not spec:
        return
    key = f"model.attention.heads_per_layer={m.attention.heads_per_layer!r}"
    counts = spec.split(",")
    require(
        all(c.strip().isascii() and c.strip().isdigit() for c in counts) and len(counts) == m.n_layers,
        f"{key} must be {m.n_layers} comma-separated head counts, one per layer (model.n_layers)",
    )
    group = m.n_heads // (m.n_kv_heads or m.n_heads)
    require(
        all(1 <= int(c) <= m.n_heads and int(c) % group == 0 for c in counts),
        f"{key}: each count must be a multiple of the GQA group size n_heads/n_kv_heads={group} in [{group}, "
        f"{m.n_heads}]",
    )
    refused = [
        (m.arch == "encoder_decoder", "arch='encoder_decoder'"),
        (m.position.kind in ("t5_bias", "alibi"), f"position.kind='{m.position.kind}' (a bias per head)"),
        (m.mla.kv_rank > 0, "model.mla (latent attention)"),
        ("M" in m.layer_pattern, "Mamba layers"),
        ("D" in m.layer_pattern, "Gated DeltaNet layers"),
    ]
    unsupported = next((name for hit, name in refused if hit), "")
    require(
        not unsupported,
        f"{key} is not supported with {unsupported}; per-layer head counts need a decoder or "
        "encoder of standard attention layers without per-head position biases",
    )


def _validate_position(m: ModelConfig) -> None:
    pos = m.position
    require_all("model.position", pos, ("rel_buckets", "rel_max_distance"), positive=True)
    require_all("model.position", pos, ("rope_original_max_len",), positive=False)
    require(pos.rope_theta > 0, f"model.position.rope_theta must be positive, got {pos.rope_theta}")
    head_dim = m.mla.rope_head_dim if m.mla.kv_rank else m.head_dim or m.dim // m.n_heads
    rot = int(head_dim * pos.rotary_fraction)
    require(
        0.0 < pos.rotary_fraction <= 1.0, f"model.position.rotary_fraction must be in (0, 1], got {pos.rotary_fraction}"
    )
    require(
        pos.kind != "rope" or (rot > 0 and rot % 2 == 0),
        "model.position.kind='rope' needs an even rotary width, got "
        f"head_dim*rotary_fraction={head_dim * pos.rotary_fraction:g}; change model.position.rotary_fraction or "
        "model.head_dim",
    )
    require(
        pos.rope_scaling_factor >= 1.0,
        f"model.position.rope_scaling_factor must be >= 1, got {pos.rope_scaling_factor}",
    )
    require(
        pos.rope_scaling != "llama3" or 0 < pos.rope_low_freq_factor < pos.rope_high_freq_factor,
        "model.position.rope_low_freq_factor must be positive and below model.position.rope_high_freq_factor, got "
        f"{pos.rope_low_freq_factor} and {pos.rope_high_freq_factor}",
    )
    require(
        pos.rope_attention_factor >= 0,
        f"model.position.rope_attention_factor must be >= 0, got {pos.rope_attention_factor}",
    )
    require(
        pos.rel_buckets % 2 == 0 and pos.rel_buckets >= 4,
        f"model.position.rel_buckets must be an even number >= 4, got {pos.rel_buckets}",
    )
    require(
        m.arch != "encoder_decoder" or pos.kind != "alibi",
        "model.position.kind='alibi' is not supported for arch='encoder_decoder'",
    )


def _validate_moe(moe: MoEConfig) -> None:
    require_all("model.moe", moe, ("experts", "shared_experts", "ffn_hidden", "first_dense"), positive=False)
    require_all("model.moe", moe, ("shared_ffn_hidden", "bias_update_rate"), positive=False)
    require_all("model.moe", moe, ("every", "groups", "topk_groups", "route_scale"), positive=True)
    if not moe.experts:
        return
    require(
        1 <= moe.top_k <= moe.experts, f"model.moe.top_k={moe.top_k} must be in [1, model.moe.experts={moe.experts}]"
    )
    require(
        moe.capacity_factor >= 0, f"model.moe.capacity_factor must be >= 0 (0 = dropless), got {moe.capacity_factor}"
    )
    require(
        moe.aux_loss_coef >= 0 and moe.z_loss_coef >= 0,
        "model.moe.aux_loss_coef and model.moe.z_loss_coef must be >= 0",
    )
    require(
        moe.experts % moe.groups == 0,
        f"model.moe.groups={moe.groups} must divide model.moe.experts={moe.experts} (equal expert groups)",
    )
    per_group = moe.experts // moe.groups
    require(
        moe.topk_groups <= moe.groups and moe.top_k <= moe.topk_groups * per_group,
        f"model.moe.topk_groups={moe.topk_groups} groups of {per_group} experts cannot hold top_k={moe.top_k}; "
        f"use topk_groups in [1, groups={moe.groups}] with topk_groups * experts / groups >= top_k",
    )
    require(
        not moe.shared_gate or moe.shared_experts > 0,
        "model.moe.shared_gate gates the shared experts; set model.moe.shared_experts > 0",
    )


LAYER_KINDS = {"A": "attention", "G": "global attention", "M": "Mamba", "D": "Gated DeltaNet"}


def _validate_mixers(m: ModelConfig) -> None:
    """model.layer_pattern, [model.mamba] and [model.mla]."""
    pattern = m.layer_pattern
    bad = sorted(set(pattern) - set(LAYER_KINDS))
    require(
        not bad,
        f"model.layer_pattern={pattern!r} has {bad[0]!r}; use one letter per layer: "
        + ", ".join(f"{k} ({v})" for k, v in LAYER_KINDS.items())
        if bad
        else "",
    )
    require(
        not pattern or m.n_layers % len(pattern) == 0,
        f"model.layer_pattern has {len(pattern)} letters, which do not tile model.n_layers={m.n_layers}; use a "
        "divisor of n_layers letters",
    )
    require(
        m.arch == "decoder" or not (set(pattern) - {"A"} or m.mla.kv_rank),
        f"model.layer_pattern and model.mla are for decoders, not model.arch='{m.arch}'",
    )
    require(
        "G" not in pattern or (m.attention.sliding_window > 0 and m.attention.kernel in ("sdpa", "eager")),
        "model.layer_pattern 'G' (global attention) needs model.attention.sliding_window > 0 and the sdpa or "
        "eager kernel",
    )
    if "M" in pattern:
        _validate_mamba(m)
    if "D" in pattern:
        _validate_gdn(m)
    mla = m.mla
    if mla.kv_rank:
        require_all("model.mla", mla, ("rope_head_dim", "v_head_dim"), positive=True)
        require_all("model.mla", mla, ("q_rank", "nope_head_dim", "mscale"), positive=False)
        require(
            m.position.kind == "rope" and m.attention.kernel in ("sdpa", "eager"),
            "model.mla needs model.position.kind='rope' and model.attention.kernel sdpa or eager",
        )
    require(0.0 <= m.moe.jitter < 1.0, f"model.moe.jitter must be in [0, 1), got {m.moe.jitter}")


def _validate_mamba(m: ModelConfig) -> None:
    mamba = m.mamba
    require(mamba.version in (1, 2), f"model.mamba.version must be 1 or 2, got {mamba.version}")
    require_all("model.mamba", mamba, ("state", "conv", "expand", "head_dim", "groups", "chunk"), positive=True)
    require_all("model.mamba", mamba, ("dt_rank",), positive=False)
    require(mamba.version == 1 or not mamba.dt_norm, "model.mamba.dt_norm (Jamba) is a Mamba-1 option; set version = 1")
    if mamba.version == 2:
        inner = mamba.expand * m.dim
        require(
            inner % mamba.head_dim == 0 and (inner // mamba.head_dim) % mamba.groups == 0,
            f"model.mamba: the inner width expand*dim={inner} must split into heads of head_dim={mamba.head_dim}, "
            f"and the heads into groups={mamba.groups}",
        )


def _validate_gdn(m: ModelConfig) -> None:
    gdn = m.gdn
    require_all("model.gdn", gdn, ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv", "chunk"),
                positive=True)
    require(
        gdn.value_heads % gdn.key_heads == 0,
        f"model.gdn.value_heads={gdn.value_heads} must be a multiple of model.gdn.key_heads={gdn.key_heads} (each key "
        "head serves a group of value heads)",
    )


def check_document_masks(job: JobConfig) -> None:
    """Packed-document masks reset every recurrent state (Mamba, Mamba-2, Gated DeltaNet) at each boundary; the
    linear attention kernels' prefix sums (elu+1, Performer) cannot stop at one yet."""
    kernel = job.model.attention.kernel
    require(
        not (job.data.document_mask and kernel in ("linear", "performer")),
        f"data.document_mask cannot stop model.attention.kernel='{kernel}' at document boundaries; set "
        "data.document_mask=false or use the sdpa or eager kernel",
    )
