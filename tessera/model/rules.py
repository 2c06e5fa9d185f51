"""The rules of the [model] keys read together: what the zoo can build, checked before anything is built.

``validate_model`` also checks model configs that come from elsewhere (an HF checkpoint, a pruned
model); ``tessera.validate.validate`` runs it first for every job.
"""

from __future__ import annotations

from tessera import registry
from tessera.config import JobConfig, ModelConfig
from tessera.config.checks import require, require_all, require_finite
from tessera.model import components, mixers  # noqa: F401  (components: registers every spec)


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
    _validate_moe(m)
    _validate_mixers(m)


def _validate_attention(m: ModelConfig) -> None:
    a = m.attention
    require_all("model.attention", a, ("sliding_window", "global_tokens", "scale"), positive=False)
    require_all("model.attention", a, ("block_size", "random_blocks", "performer_features"), positive=True)
    require(0.0 <= a.dropout < 1.0, f"model.attention.dropout must be in [0, 1), got {a.dropout}")
    kernels = registry.names("attention_kernel")
    require(
        a.kernel in kernels,
        f"model.attention.kernel = {a.kernel!r} is not a registered kernel; use one of {', '.join(map(repr, kernels))}",
    )
    run_checks(m, "attention_kernel")
    run_checks(m, "option")


def run_checks(m: ModelConfig, kind: str) -> None:
    """The checks of every ``kind`` spec this model uses (each declared next to its component's code)."""
    for spec in registry.used_by_model(m, kind):
        for check in spec.checks or ():
            check(m)


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
    require(
        0.0 < pos.rotary_fraction <= 1.0, f"model.position.rotary_fraction must be in (0, 1], got {pos.rotary_fraction}"
    )
    run_checks(m, "position")
    require(
        pos.rope_scaling_factor >= 1.0,
        f"model.position.rope_scaling_factor must be >= 1, got {pos.rope_scaling_factor}",
    )
    require(
        pos.rope_scaling != "llama3" or 0 < pos.rope_low_freq_factor <= pos.rope_high_freq_factor,
        "model.position.rope_low_freq_factor must be positive and at most model.position.rope_high_freq_factor, got "
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


def _validate_moe(m: ModelConfig) -> None:
    moe = m.moe
    require_all("model.moe", moe, ("experts", "shared_experts", "ffn_hidden", "first_dense"), positive=False)
    require_all("model.moe", moe, ("shared_ffn_hidden", "bias_update_rate"), positive=False)
    require_all("model.moe", moe, ("every", "groups", "topk_groups", "route_scale"), positive=True)
    run_checks(m, "ffn")


def _validate_mixers(m: ModelConfig) -> None:
    """model.layer_pattern, [model.mamba] and [model.mla]."""
    pattern = m.layer_pattern
    letters = mixers.layer_letters()
    bad = sorted(set(pattern) - set(letters))
    require(
        not bad,
        f"model.layer_pattern={pattern!r} has {bad[0]!r}; use one letter per layer: "
        + ", ".join(f"{k} ({v})" for k, v in letters.items())
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
    kernel = registry.get("attention_kernel", m.attention.kernel)
    require(
        "G" not in pattern
        or ((m.attention.sliding_window > 0 or m.attention.chunk_size > 0) and kernel.scores and not kernel.pattern),
        "model.layer_pattern 'G' (global attention) needs model.attention.sliding_window > 0 (or chunk_size > 0) "
        "and a softmax kernel "
        "without its own pattern (sdpa, eager, chunked)",
    )
    run_checks(m, "mixer")
    require(0.0 <= m.moe.jitter < 1.0, f"model.moe.jitter must be in [0, 1), got {m.moe.jitter}")


def check_document_masks(job: JobConfig) -> None:
    """Packed-document masks reset every recurrent state (Mamba, Mamba-2, Gated DeltaNet) at each boundary; the
    linear attention kernels' prefix sums (elu+1, Performer) cannot stop at one yet."""
    kernel = job.model.attention.kernel
    require(
        not (job.data.document_mask and not registry.get("attention_kernel", kernel).scores),
        f"data.document_mask cannot stop model.attention.kernel='{kernel}' at document boundaries; set "
        "data.document_mask=false or use the sdpa or eager kernel",
    )
