"""Keys of earlier releases and where they live now: recipes, overrides and checkpoints written
before a key moved keep loading. A sub-table name given a plain value sets its first key."""

from __future__ import annotations

RENAMED: dict[str, str] = {
    "checkpoint.async": "checkpoint.async_save",  # `async` is a Python keyword, so the field cannot be named so
    "model.attention": "model.attention.kernel",
    "model.position": "model.position.kind",
    "model.attn_dropout": "model.attention.dropout",
    "model.attn_scale": "model.attention.scale",
    **{
        f"model.{k}": f"model.attention.{k}"
        for k in (
            "qkv_bias",
            "qk_norm",
            "sliding_window",
            "global_tokens",
            "block_size",
            "random_blocks",
            "performer_features",
        )
    },
    **{
        f"model.{k}": f"model.position.{k}"
        for k in (
            "rope_theta",
            "rope_scaling",
            "rope_scaling_factor",
            "rope_original_max_len",
            "rotary_fraction",
            "rel_buckets",
            "rel_max_distance",
        )
    },
    **{
        f"model.moe_{k}": f"model.moe.{k}"
        for k in (
            "experts",
            "top_k",
            "every",
            "router",
            "capacity_factor",
            "aux_loss_coef",
            "z_loss_coef",
            "shared_experts",
            "ffn_hidden",
            "first_dense",
            "norm_topk",
            "route_scale",
            "groups",
            "topk_groups",
            "aux_loss_scope",
            "expert_bias",
            "bias_update_rate",
            "shared_ffn_hidden",
            "shared_gate",
        )
    },
    **{f"optim.muon_{k}": f"optim.muon.{k}" for k in ("lr", "momentum", "nesterov", "ns_steps", "ns_dtype", "scale")},
    "train.distill_from": "train.distill.teacher",
    **{f"train.distill_{k}": f"train.distill.{k}" for k in ("temperature", "alpha")},
    "parallel.deepspeed_config": "parallel.deepspeed.config",
    **{
        f"parallel.{k}": f"parallel.deepspeed.{k}"
        for k in ("zero_stage", "offload_optimizer", "offload_params", "nvme_path")
    },
}
