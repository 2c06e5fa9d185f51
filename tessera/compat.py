"""The compatibility matrix: which features combine with which parallel layouts.

Declared once here, enforced by config validation (before any process starts) and rendered
into docs/parallelism/index.md by :func:`render_markdown`. A layout is the set of active parallel dimensions
of a job; a feature is something a config turns on. Every (feature, dimension) pair the job
uses must be supported.
"""

from __future__ import annotations

from typing import Any

LAYOUTS = ("single", "ddp", "fsdp", "hsdp", "tp", "sp", "pp", "cp", "ep", "deepspeed")

# feature -> layouts it does NOT support, with the reason shown to the user. "sp" is tensor
# parallelism with sequence parallelism on, so it inherits every "tp" entry (a job with sp
# also has tp and is refused there); only what fails with sp alone is listed under "sp".
UNSUPPORTED: dict[str, dict[str, str]] = {
    "training": {},
    "activation checkpointing": {},
    "op-level selective checkpointing": {
        "ep": "the recompute replays FSDP's hooks of the sharded experts inside the block, which op-level "
        "checkpointing rejects; use parallel.activation_checkpoint=full or selective",
        "deepspeed": "op-level checkpointing is not validated with ZeRO's hooks; use "
        "parallel.activation_checkpoint=full or selective",
    },
    "torch.compile": {
        "deepspeed": "compile is not validated with the DeepSpeed engine yet; set parallel.compile=false",
    },
    "bf16": {},
    "fp16": {
        "ep": "fp16 with expert parallelism is not validated yet; use bf16",
        "deepspeed": "fp16 with the DeepSpeed engine is not validated yet (its CPU accelerator refuses fp16); use bf16",
    },
    "cpu offload (CUDA)": {
        "single": "offload is an FSDP feature; shard with parallel.dp_shard > 1",
        "ddp": "offload is an FSDP feature; shard with parallel.dp_shard > 1",
        "tp": "offload with tensor parallelism is not supported",
        "pp": "offload is not validated with pipeline stages yet",
        "ep": "offload is not validated with expert parallelism yet",
        "deepspeed": "the DeepSpeed engine offloads with parallel.deepspeed.offload_optimizer / offload_params",
    },
    "meta init": {
        "deepspeed": "the DeepSpeed engine partitions a built model; set parallel.meta_init=false",
    },
    "tied embeddings": {},
    "encoder (masked LM)": {},
    "encoder-decoder": {
        "cp": "context parallelism is validated end to end for decoders; an encoder-decoder's cross-attention memory "
        "is not split",
    },
    "absolute positions (learned, sinusoidal)": {},
    "T5 relative-position bias": {},
    "ALiBi": {},
    "sparse attention kernels (longformer, bigbird)": {},
    "linear attention kernels (linear, performer)": {
        "cp": "the kernel's prefix sums over keys are not split across ranks; use sdpa, eager or a sparse kernel",
    },
    "mixture of experts": {},
    "MoE capacity limit (token dropping)": {
        "cp": "which tokens an expert drops depends on their order across the ranks' slices; use "
        "model.moe.capacity_factor=0 (dropless)",
    },
    "QK-norm over all heads": {
        "tp": "the norm spans every head's channels, which tensor parallelism splits over ranks",
    },
    "Mamba layers": {
        "tp": "the tensor-parallel plan shards attention and FFN projections, not the Mamba mixer",
        "cp": "context parallelism splits attention over the sequence, not the recurrent scan",
    },
    "Gated DeltaNet layers": {
        "cp": "the delta-rule state is not passed between context-parallel ranks yet",
    },
    "gated attention": {},
    "multi-token prediction": {
        "cp": "the MTP modules read the tokens ahead of each position, which context parallelism puts on other ranks",
        "deepspeed": "not validated with the DeepSpeed engine yet; use parallel.engine='torch' (FSDP/DDP/TP/PP)",
    },
    "distillation": {
        "tp": "the KL term needs each position's whole vocabulary, which tensor parallelism shards; use data "
        "parallelism",
        "pp": "the teacher's logits would have to reach the pipeline's last stage; use data parallelism",
        "cp": "the teacher would need the whole sequence; use data parallelism",
        "deepspeed": "not validated with the DeepSpeed engine yet; use parallel.engine='torch' with data parallelism",
    },
    "latent attention": {
        "tp": "the tensor-parallel plan does not cover latent attention's projections",
        "cp": "context parallelism's attention (all-gather or ring) exchanges standard attention's keys and values, "
        "not the latent cache",
    },
}


# Pairs of layouts that do not combine, with the reason.
UNSUPPORTED_PAIRS: dict[frozenset[str], str] = {
    **{
        frozenset({"deepspeed", layout}): f"the DeepSpeed engine is data parallel only; set parallel.{key}=1 "
        "or parallel.engine='torch'"
        for layout, key in (("ddp", "dp_replicate"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"))
    },
}


def job_layouts(parallel: Any, world_size: int | None = None) -> set[str]:
    """The layouts a ``[parallel]`` section uses.

    Without a world size, ``dp_shard = -1`` is unknown, so the data-parallel layout (and
    "single") is left out; it is checked again once the launcher knows the world size.
    """
    layouts = set()
    for dim in ("tp", "pp", "cp", "ep"):
        if getattr(parallel, dim) > 1:
            layouts.add(dim)
    if parallel.tp > 1 and parallel.sequence_parallel:
        layouts.add("sp")
    if parallel.engine == "deepspeed":  # ZeRO over every rank; dp_replicate > 1 shows as ddp (refused)
        return layouts | {"deepspeed"} | ({"ddp"} if parallel.dp_replicate > 1 else set())
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size is None:
            return layouts
        dp_shard = max(1, world_size // (parallel.dp_replicate * parallel.tp * parallel.pp * parallel.cp))
    sharded = dp_shard * parallel.cp > 1  # FSDP shards parameters over dp_shard x cp
    if parallel.dp_replicate > 1:
        layouts.add("hsdp" if sharded else "ddp")
    elif sharded:
        layouts.add("fsdp")
    return layouts or {"single"}


def job_features(config: Any) -> set[str]:
    """The features of :data:`UNSUPPORTED` a job turns on."""
    p, m = config.parallel, config.model
    features = {"training"}
    if p.activation_checkpoint != "none":
        features.add("activation checkpointing")
    if p.activation_checkpoint == "op":
        features.add("op-level selective checkpointing")
    if p.compile is True:  # "auto" compiles only where it is supported
        features.add("torch.compile")
    if config.train.dtype in ("bf16", "fp16"):
        features.add(config.train.dtype)
    if p.cpu_offload:
        features.add("cpu offload (CUDA)")
    if p.meta_init:
        features.add("meta init")
    if m.tie_embeddings:
        features.add("tied embeddings")
    if m.arch == "encoder":
        features.add("encoder (masked LM)")
    if m.arch == "encoder_decoder":
        features.add("encoder-decoder")
    if m.position.kind in ("learned", "sinusoidal"):
        features.add("absolute positions (learned, sinusoidal)")
    if m.position.kind == "t5_bias":
        features.add("T5 relative-position bias")
    if m.position.kind == "alibi":
        features.add("ALiBi")
    if m.attention.kernel in ("longformer", "bigbird"):
        features.add("sparse attention kernels (longformer, bigbird)")
    if m.attention.kernel in ("linear", "performer"):
        features.add("linear attention kernels (linear, performer)")
    if m.moe.experts > 1:
        features.add("mixture of experts")
        if m.moe.capacity_factor > 0:
            features.add("MoE capacity limit (token dropping)")
    if m.attention.qk_norm and m.attention.qk_norm_scope == "all":
        features.add("QK-norm over all heads")
    if "M" in m.layer_pattern:
        features.add("Mamba layers")
    if "D" in m.layer_pattern:
        features.add("Gated DeltaNet layers")
    if m.attention.output_gate:
        features.add("gated attention")
    if m.mla.kv_rank:
        features.add("latent attention")
    if m.mtp_depth:
        features.add("multi-token prediction")
    if config.train.distill.teacher:
        features.add("distillation")
    return features


def incompatibilities(config: Any, world_size: int | None = None) -> list[str]:
    """One message per unsupported (feature, layout) pair of a job; empty when all is supported."""
    layouts = job_layouts(config.parallel, world_size)
    found = []
    for feature in sorted(job_features(config)):
        for layout in sorted(layouts):
            reason = UNSUPPORTED[feature].get(layout)
            if reason is not None:
                found.append(f"{feature} with {layout}: {reason}")
    for pair, reason in UNSUPPORTED_PAIRS.items():
        if pair <= layouts:
            found.append(f"{' with '.join(sorted(pair))}: {reason}")
    return found


def render_markdown() -> str:
    """The matrix as a Markdown table (the docs' copy is checked against this by a test).

    A layout that cannot train at all shows "n/a" for every other feature; a "no" under
    ``tp`` also shows under ``sp``.
    """
    missing = UNSUPPORTED["training"]
    rows = ["| feature | " + " | ".join(LAYOUTS) + " |", "|---" * (len(LAYOUTS) + 1) + "|"]
    for feature, unsupported in UNSUPPORTED.items():
        refused = set(unsupported) | ({"sp"} if "tp" in unsupported else set())
        cells = ["no" if layout in refused else "n/a" if layout in missing else "yes" for layout in LAYOUTS]
        rows.append(f"| {feature} | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f"- not {' with '.join(sorted(pair))}: {reason}" for pair, reason in UNSUPPORTED_PAIRS.items()]
    rows += [f"- no {layout}: {reason}" for layout, reason in missing.items()]
    return "\n".join(rows)
