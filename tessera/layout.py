"""Pure layout arithmetic and the one layout check: degrees, pipeline plan, batch divisibility.

Nothing here touches torch.distributed or the model: :func:`check_layout` runs at config time
(``world_size=None``: what can be known without the launcher) and again once the world size is
known (the launcher and each training process), so a bad layout fails before any process group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tessera.compat import incompatibilities
from tessera.config import JobConfig, ModelConfig, ParallelConfig, layer_heads
from tessera.errors import ConfigError

MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
# Two stages per rank in a V: rank r runs stage r and stage 2 pp - 1 - r (the last stage sits beside the first).
V_SCHEDULES = ("zbv", "dualpipev")
# Input and weight gradients in separate passes (the zero-bubble family): torch.compile cannot split them.
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")


def world_size_of(p: Any, dp_shard: int | None = None) -> int:
    """The processes a layout takes: dp_replicate x dp_shard x cp x tp x pp (``p``: a ``[parallel]`` section,
    ``ParallelDims`` or a planner ``Layout``; ``dp_shard`` in place of ``p``'s). The one product of the degrees
    (expert parallelism reuses ranks of dp_shard x cp x tp, so ``ep`` is not a factor)."""
    shard = p.dp_shard if dp_shard is None else dp_shard
    return p.dp_replicate * shard * p.cp * p.tp * p.pp


def data_parallel_degree(p: Any, dp_shard: int | None = None) -> int:
    """How many different batches a layout processes at once: dp_replicate x dp_shard."""
    return p.dp_replicate * (p.dp_shard if dp_shard is None else dp_shard)


def resolve_dp_shard(p: ParallelConfig, world_size: int) -> int:
    """``parallel.dp_shard`` for ``world_size`` processes (-1 takes what the other degrees leave)."""
    others = world_size_of(p, dp_shard=1)
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"the world size {world_size} is not divisible by dp_replicate*cp*tp*pp={others}; "
                "launch a multiple of that many processes or change the parallel degrees"
            )
        dp_shard = world_size // others
    if world_size_of(p, dp_shard) != world_size:
        raise ConfigError(
            f"parallel degrees dp_replicate={p.dp_replicate} x dp_shard={dp_shard} x cp={p.cp} x tp={p.tp} "
            f"x pp={p.pp} = {others * dp_shard}, but {world_size} process(es) were launched; "
            "make them equal (dp_shard=-1 takes the rest)"
        )
    return dp_shard


def virtual_stages(p: ParallelConfig) -> int:
    """Stages per rank: ``parallel.pp_virtual_stages``, or 2 for the multi-stage schedules, else 1."""
    if p.pp_virtual_stages:
        return p.pp_virtual_stages
    return 2 if p.pp_schedule in MULTI_STAGE_SCHEDULES else 1


def microbatches(p: ParallelConfig) -> int:
    """Micro-batches per pipeline step: ``parallel.microbatches``, or ``pp`` when 0."""
    return p.microbatches or p.pp


COST_SPLIT = "cost"  # parallel.layers_per_stage: balance the stages' estimated FLOPs, the head's included


def stage_layer_counts(n_layers: int, n_stages: int, layers_per_stage: str = "") -> list[int]:
    """Blocks per stage: the explicit comma-separated list, or ``n_layers`` balanced by count
    (``"cost"`` is resolved into a list by ``tessera.plan.shapes.cost_split`` first)."""
    if layers_per_stage == COST_SPLIT:
        raise ValueError("resolve parallel.layers_per_stage='cost' with tessera.plan.shapes.cost_split first")
    if layers_per_stage:
        return [int(c) for c in layers_per_stage.split(",")]
    return [n_layers // n_stages + (1 if i < n_layers % n_stages else 0) for i in range(n_stages)]


def cost_balanced_counts(block_costs: list[float], last_stage_extra: float, n_stages: int) -> list[int]:
    """Blocks per stage, contiguous and at least one each, that minimize the costliest stage's cost.

    ``block_costs`` in model order; ``last_stage_extra`` is what the last stage runs besides its blocks
    (the head and the loss). Among splits with the same maximum, the one closest to even counts wins.
    """
    n = len(block_costs)
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: (max stage cost, count imbalance) of the first i blocks in s stages, and its last cut
    inf = (float("inf"), float("inf"))
    even = n / n_stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        extra = last_stage_extra if s == n_stages else 0.0
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                prev = best[s - 1][j]
                cand = (max(prev[0], prefix[i] - prefix[j] + extra), prev[1] + abs(i - j - even))
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    counts, i = [], n
    for s in range(n_stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def pipeline_blocks(m: ModelConfig) -> int:
    """The blocks a pipeline splits into stages: the encoder's then the decoder's for an encoder-decoder."""
    return m.n_layers + ((m.n_decoder_layers or m.n_layers) if m.arch == "encoder_decoder" else 0)


def local_stage_ids(rank: int, pp: int, v: int, schedule: str = "1f1b") -> list[int]:
    """The stage indices a pp rank runs: looped, ``rank + k*pp`` for each of its ``v`` stages, or in a V
    for the V schedules (``rank`` and ``2 pp - 1 - rank``)."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def stage_rank(stage: int, pp: int, schedule: str = "1f1b") -> int:
    """The pp rank that runs ``stage`` (the inverse of :func:`local_stage_ids`)."""
    if schedule in V_SCHEDULES and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def check_layout(config: JobConfig, world_size: int | None = None) -> None:
    """Raise a one-line ConfigError when the job's layout cannot run (on ``world_size`` processes).

    Without a world size, ``dp_shard = -1`` leaves the data-parallel degree unknown and the
    checks that need it wait for the second call.
    """
    p = config.parallel
    _check_degrees(p)
    _check_tensor_parallel(config)
    _check_context_parallel(config)
    dp_shard = resolve_dp_shard(p, world_size) if world_size is not None else p.dp_shard
    dp = data_parallel_degree(p, dp_shard) if dp_shard != -1 else None
    _check_pipeline_plan(config)
    _check_expert_parallel(config, dp_shard)
    if dp is not None:
        _check_batch(config, dp)
    resolved = dataclasses.replace(config, parallel=dataclasses.replace(p, dp_shard=dp_shard))
    problems = incompatibilities(resolved)  # dp_shard resolved here: compat computes no degree product
    if problems:
        raise ConfigError(
            f"unsupported parallel combination: {problems[0]}"
            " (see the compatibility table in docs/parallelism/index.md)"
        )


def check_model_layout(config: JobConfig) -> None:
    """The checks of :func:`check_layout` that a model's shape decides (tensor and context parallelism): for
    a second model under the job's layout, such as a distillation teacher (whole, on the last pipeline stage)."""
    _check_tensor_parallel(config)
    _check_context_parallel(config)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_degrees(p: ParallelConfig) -> None:
    for key in ("dp_replicate", "tp", "pp", "cp", "ep"):
        _require(getattr(p, key) >= 1, f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    _require(p.dp_shard == -1 or p.dp_shard >= 1, f"parallel.dp_shard must be >= 1 or -1 (the rest), got {p.dp_shard}")
    _require(p.ac_every >= 1, f"parallel.ac_every must be >= 1, got {p.ac_every}")
    _require(
        p.microbatches >= 0 and p.pp_virtual_stages >= 0,
        "parallel.microbatches and parallel.pp_virtual_stages must be >= 0 (0 = default), "
        f"got {p.microbatches}, {p.pp_virtual_stages}",
    )


def _check_tensor_parallel(config: JobConfig) -> None:
    p, m, t = config.parallel, config.model, config.train
    if p.tp == 1:
        return
    kv = m.n_kv_heads or m.n_heads
    _require(
        m.n_heads % p.tp == 0,
        f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}; pick a tp that divides the head count",
    )
    _require(
        kv % p.tp == 0,
        f"model.n_kv_heads={kv} is not divisible by parallel.tp={p.tp}; use tp <= n_kv_heads that divides it",
    )
    _check_layer_heads(m, p.tp)
    for letter, name, section, heads in _DELTA_RULE_MIXERS:
        if letter in m.layer_pattern:
            _check_delta_rule_tp(config, name, section, heads)
    if "M" in m.layer_pattern:
        _check_mamba_tp(m, p)
    _require(
        m.vocab_size % p.tp == 0,
        f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={p.tp}; "
        "round the vocabulary up to a multiple of tp",
    )
    _require(
        not p.sequence_parallel or t.seq_len % (p.tp * p.cp) == 0,
        f"train.seq_len={t.seq_len} is not divisible by parallel.tp={p.tp}"
        + (f" x parallel.cp={p.cp}" if p.cp > 1 else "")
        + " (sequence parallelism splits each rank's tokens); change seq_len or set parallel.sequence_parallel=false",
    )


def _check_mamba_tp(m: ModelConfig, p: ParallelConfig) -> None:
    """Mamba layers under tp: whole channels (Mamba-1) or whole heads and B/C groups (Mamba-2) per rank."""
    mamba, inner = m.mamba, m.mamba.expand * m.dim
    if mamba.version == 1:
        _require(
            inner % p.tp == 0,
            f"the Mamba inner width model.mamba.expand x model.dim = {inner} is not divisible by parallel.tp={p.tp}; "
            "pick a tp that divides it",
        )
    else:
        _require(
            (inner // mamba.head_dim) % p.tp == 0 and mamba.groups % p.tp == 0,
            f"Mamba-2 under parallel.tp={p.tp} needs whole heads ({inner // mamba.head_dim}) and B/C groups "
            f"(model.mamba.groups={mamba.groups}) per rank (its gated norm is per group); set model.mamba.groups to a "
            "multiple of tp",
        )


def _check_context_parallel(config: JobConfig) -> None:
    p, m, t = config.parallel, config.model, config.train
    if p.cp == 1:
        return
    _require(  # an encoder-decoder splits its encoder and decoder sequences (tessera.data.rules)
        t.seq_len % (2 * p.cp) == 0 or m.arch == "encoder_decoder",
        f"train.seq_len={t.seq_len} is not divisible by 2 x parallel.cp={2 * p.cp} (context parallelism cuts each "
        f"sequence into 2*cp equal chunks, two per rank); make seq_len a multiple of {2 * p.cp}",
    )
    _require(
        p.cp_method != "ring" or m.attention.dropout == 0,
        f"parallel.cp_method='ring' computes attention without dropout, but model.attention.dropout="
        f"{m.attention.dropout}; set it to 0 or use parallel.cp_method=allgather",
    )
    _require(
        p.cp_method != "ring" or m.position.kind not in ("alibi", "t5_bias"),
        f"parallel.cp_method='ring' adds no score bias, but model.position.kind='{m.position.kind}'; use "
        "parallel.cp_method=allgather (the bias spans the gathered keys) or rope/learned positions",
    )
    for letter, name, section, _ in _DELTA_RULE_MIXERS:
        if letter in m.layer_pattern:
            _check_delta_rule_cp(config, name, section)
    piece = t.seq_len // (2 * p.cp)
    _require(
        "M" not in m.layer_pattern or piece >= m.mamba.conv - 1,
        f"model.mamba.conv={m.mamba.conv} is wider than the local sequence piece train.seq_len / (2 x parallel.cp) "
        f"= {piece} + 1 (a piece's convolution window reaches only into the piece before it); use a longer seq_len",
    )
    _require(
        m.arch == "decoder" or m.attention.kernel not in ("linear", "performer"),
        f"model.attention.kernel='{m.attention.kernel}' under context parallelism is causal only (the split form "
        f"combines prefix sums), not model.arch='{m.arch}'; set parallel.cp=1 or use sdpa",
    )


# The delta-rule mixers: their layer_pattern letter, name, [model.<section>] and the heads a tp rank holds whole.
_DELTA_RULE_MIXERS = (("D", "Gated DeltaNet", "gdn", "key_heads"), ("K", "Kimi Delta Attention", "kda", "heads"))


def _check_delta_rule_tp(config: JobConfig, name: str, section: str, heads: str) -> None:
    """Whole heads (GDN: key-head groups) per tp rank; KDA's low-rank decay and gate projections (dim -> head_dim)
    split too."""
    p, sub = config.parallel, getattr(config.model, section)
    count = getattr(sub, heads)
    _require(
        count % p.tp == 0,
        f"model.{section}.{heads}={count} is not divisible by parallel.tp={p.tp} (each rank holds whole "
        f"{name} {'key-head groups' if section == 'gdn' else 'heads'}); pick a tp that divides it",
    )
    if section == "kda":
        _require(
            sub.head_dim % p.tp == 0,
            f"model.kda.head_dim={sub.head_dim} is not divisible by parallel.tp={p.tp} (the decay and gate "
            "projections' low-rank halves are split over the ranks); pick a tp that divides it",
        )


def _check_delta_rule_cp(config: JobConfig, name: str, section: str) -> None:
    """A delta-rule mixer under cp scans each rank's two chunks (seq_len / 2cp tokens) in whole scan chunks."""
    p, g, t = config.parallel, getattr(config.model, section), config.train
    piece = t.seq_len // (2 * p.cp)
    _require(
        piece % g.chunk == 0 and piece >= g.conv - 1,
        f"model.{section}.chunk={g.chunk} does not divide the local sequence piece train.seq_len / (2 x parallel.cp) "
        f"= {piece} ({name} under context parallelism); pick a chunk that divides {piece}",
    )


def _check_layer_heads(m: ModelConfig, tp: int) -> None:
    """Every layer's query and KV heads split evenly over tp ranks (``model.attention.heads_per_layer``)."""
    if not m.attention.heads_per_layer:
        return
    kv = m.n_kv_heads or m.n_heads
    for i, heads in enumerate(layer_heads(m)):
        _require(
            heads % tp == 0 and heads * kv // m.n_heads % tp == 0,
            f"layer {i} of model.attention.heads_per_layer={m.attention.heads_per_layer!r} has {heads} query and "
            f"{heads * kv // m.n_heads} KV heads, not divisible by parallel.tp={tp}; use a tp that divides them",
        )


def check_expert_degree(ep: int, dp_shard: int, cp: int, tp: int) -> None:
    """ep is carved out of ``dp_shard x cp x tp``: a multiple of ``cp x tp`` that divides it.

    ``dp_shard = -1`` (not resolved yet) skips the second check.
    """
    _require(
        ep % (cp * tp) == 0,
        f"parallel.ep={ep} must be a multiple of cp*tp={cp * tp} (expert parallelism takes every cp and tp rank "
        "of a group, then data-parallel shards); raise ep or lower cp/tp",
    )
    _require(
        dp_shard == -1 or (dp_shard * cp * tp) % ep == 0,
        f"parallel.ep={ep} must divide dp_shard*cp*tp={dp_shard * cp * tp} (experts are spread over data-parallel "
        "shards and tp ranks); pick an ep that divides it or raise parallel.dp_shard",
    )


def _check_expert_parallel(config: JobConfig, dp_shard: int) -> None:
    p, moe = config.parallel, config.model.moe
    if p.ep == 1:
        return
    _require(moe.experts > 0, f"parallel.ep={p.ep} shards experts, but the model has none; set model.moe.experts > 0")
    _require(
        moe.experts % p.ep == 0,
        f"model.moe.experts={moe.experts} is not divisible by parallel.ep={p.ep}; "
        "every ep rank holds experts/ep experts",
    )
    check_expert_degree(p.ep, dp_shard, p.cp, p.tp)


def _check_batch(config: JobConfig, dp: int) -> None:
    """The global batch splits evenly over data-parallel ranks (and their pipeline micro-batches)."""
    batch, p = config.train.batch_size, config.parallel
    mb = microbatches(p) if p.pp > 1 else 1
    if batch % (dp * mb):
        what = f"the data-parallel degree {dp}" + (f" x parallel.microbatches={mb}" if mb > 1 else "")
        raise ConfigError(
            f"train.batch_size={batch} (global) is not divisible by {what}; make it a multiple of {dp * mb}"
        )


def _check_pipeline_plan(config: JobConfig) -> None:
    p, m = config.parallel, config.model
    if p.pp == 1:
        _require(
            p.layers_per_stage in ("", COST_SPLIT),
            f"parallel.layers_per_stage={p.layers_per_stage!r} splits a pipeline into stages, but parallel.pp=1 has "
            "none; drop it or set parallel.pp > 1",
        )
        return
    schedule, v, mb = p.pp_schedule, virtual_stages(p), microbatches(p)
    multi = schedule in MULTI_STAGE_SCHEDULES
    _require(  # measured on the tiny Mixtral at pp2: 2.0e-3 off one process, 0.37 at pp2 x ep2 (dense: 6e-8)
        not (m.moe.experts and schedule in SPLIT_BACKWARD_SCHEDULES),
        f"parallel.pp_schedule='{schedule}' splits each backward into input and weight passes, which does not "
        "match one process with MoE layers yet; use 1f1b, gpipe or interleaved_1f1b with model.moe",
    )
    _require(
        not multi or v >= 2,
        f"parallel.pp_schedule='{schedule}' needs several stages per rank; "
        "set parallel.pp_virtual_stages >= 2 (or 0 for the default 2)",
    )
    _require(
        multi or v == 1,
        f"parallel.pp_schedule='{schedule}' runs one stage per rank; "
        "set parallel.pp_virtual_stages=1 or use interleaved_1f1b / interleaved_zb",
    )
    _require(
        schedule not in V_SCHEDULES or v == 2,
        f"parallel.pp_schedule='{schedule}' runs exactly two stages per rank (a V); set parallel.pp_virtual_stages=2 "
        "(or 0)",
    )
    _require(
        schedule != "dualpipev" or mb >= 2 * p.pp,
        f"parallel.pp_schedule='dualpipev' needs microbatches >= 2 * pp = {2 * p.pp}, got parallel.microbatches={mb}",
    )
    _check_stage_split(p, pipeline_blocks(m), p.pp * v, m.arch == "encoder_decoder")
    _require(
        schedule != "1f1b" or mb >= p.pp,
        f"parallel.pp_schedule='1f1b' needs microbatches >= pp, got parallel.microbatches={mb} with pp={p.pp}",
    )
    _require(
        not multi or mb % p.pp == 0,
        f"parallel.pp_schedule='{schedule}' needs parallel.microbatches to be a multiple of pp={p.pp}, got {mb}",
    )
    _require(
        not (schedule in SPLIT_BACKWARD_SCHEDULES and p.compile is True),
        f"parallel.pp_schedule='{schedule}' splits the backward into input and weight parts, which "
        "torch.compile does not support; use 1f1b or interleaved_1f1b",
    )


def is_count(text: str) -> bool:
    """``text`` (spaces aside) is a non-negative integer in ASCII digits (``str.isdigit`` also takes superscripts
    and other scripts' digits, which ``int`` then refuses or reads differently)."""
    text = text.strip()
    return text.isascii() and text.isdigit()


def _check_stage_split(p: ParallelConfig, n_layers: int, n_stages: int, enc_dec: bool = False) -> None:
    blocks = "model.n_layers + n_decoder_layers" if enc_dec else "model.n_layers"
    if p.layers_per_stage in ("", COST_SPLIT):
        _require(
            n_stages <= n_layers,
            f"{n_stages} pipeline stages (pp={p.pp} x {n_stages // p.pp} per rank) but {blocks}={n_layers}; "
            "every stage needs a block, lower parallel.pp or pp_virtual_stages",
        )
        return
    counts = p.layers_per_stage.split(",")
    _require(
        all(is_count(c) and int(c) >= 1 for c in counts),
        f"parallel.layers_per_stage={p.layers_per_stage!r} must be comma-separated positive block counts, "
        "e.g. '3,5', or 'cost'",
    )
    _require(
        len(counts) == n_stages and sum(map(int, counts)) == n_layers,
        f"parallel.layers_per_stage={p.layers_per_stage!r} must list {n_stages} stages (pp * virtual stages) "
        f"summing to {blocks}={n_layers}",
    )
