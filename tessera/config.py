"""JobConfig: one typed, strict configuration for a tessera run.

A job is described by sections (model, parallel, optim, train, data, checkpoint, log), each a
dataclass with defaults. A TOML recipe under ``configs/`` fills them; dotted command-line
overrides (``--model.n_layers 4`` or ``model.n_layers=4``) come last. Every user mistake is a
:class:`ConfigError` with one line that names the key and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tessera.errors import ConfigError
from tessera.layout import check_layout

__all__ = ["ConfigError", "JobConfig", "ModelConfig", "load_config", "model_config"]


@dataclass
class AttentionConfig:
    """[model.attention]: the attention kernel and its options."""

    kernel: Literal["sdpa", "eager", "longformer", "bigbird", "linear", "performer"] = "sdpa"  # eager: fp32 softmax
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2, GPT-2, BERT)
    o_bias: bool = False  # a bias on o_proj also when model.bias is false (Llama attention_bias)
    dropout: float = 0.0  # on the attention weights
    scale: float = 0.0  # softmax scale; 0 means 1/sqrt(head_dim) (T5 uses 1)
    scale_by_layer: bool = False  # divide the scale by layer index + 1 (GPT-2 scale_attn_by_inverse_layer_idx)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys
    qk_norm_scope: Literal["head", "all"] = "head"  # qk_norm per head (Qwen3) or over all heads' channels (OLMoE)
    sliding_window: int = 0  # keys within this many positions (Mistral); the local width for longformer
    global_tokens: int = 0  # longformer/bigbird: the first positions attend and are attended everywhere
    block_size: int = 16  # bigbird block
    random_blocks: int = 1  # bigbird random key blocks per query block
    performer_features: int = 64  # performer random features
    heads_per_layer: str = ""  # query heads per layer, e.g. "4,2,4,2" (pruned models); "" = n_heads in every layer


@dataclass
class PositionConfig:
    """[model.position]: how token positions enter the model."""

    kind: Literal["rope", "learned", "sinusoidal", "t5_bias", "alibi", "none"] = "rope"  # t5_bias/alibi: score biases
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: Literal["none", "linear", "ntk", "yarn", "llama3"] = "none"  # context extension of RoPE
    rope_scaling_factor: float = 1.0  # how many times longer than the original context
    rope_original_max_len: int = 0  # yarn, llama3: the pre-extension context (0 = max_seq_len / factor)
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by the factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
    rope_attention_factor: float = 0.0  # yarn: the cos/sin magnitude (0 = 0.1 * ln(factor) + 1)
    rotary_fraction: float = 1.0  # partial rotary: the leading fraction of each head rotated
    rel_buckets: int = 32  # T5 relative-position buckets
    rel_max_distance: int = 128  # T5: distances beyond this share the last bucket


@dataclass
class MoEConfig:
    """[model.moe]: mixture-of-experts feed-forward layers (experts = 0 keeps every FFN dense)."""

    experts: int = 0  # 0 = dense FFN everywhere
    top_k: int = 2  # 1 = switch routing
    every: int = 1  # MoE on every n-th layer (layer i is MoE when (i + 1) % every == 0)
    first_dense: int = 0  # the first n layers keep a dense FFN (DeepSeek first_k_dense_replace)
    # Routing scores and weights: "topk_softmax" renormalizes the softmax over the k chosen experts
    # (Mixtral), "softmax_topk" keeps their raw softmax probabilities (Switch, OLMoE, Qwen2-MoE without
    # norm_topk_prob), "sigmoid" scores each expert independently (DeepSeek-V3; see norm_topk).
    router: Literal["topk_softmax", "softmax_topk", "sigmoid"] = "topk_softmax"  # Mixtral | Switch, OLMoE | DeepSeek-V3
    norm_topk: bool = True  # sigmoid router: divide the k chosen scores by their sum (HF norm_topk_prob)
    route_scale: float = 1.0  # multiplies the routing weights (DeepSeek routed_scaling_factor)
    groups: int = 1  # group-limited routing: experts split into this many groups (DeepSeek-V3 n_group)
    topk_groups: int = 1  # ... and each token picks experts from its best topk_groups groups only (topk_group)
    capacity_factor: float = 0.0  # 0 = dropless; else tokens over capacity are dropped
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch / GShard; DeepSeek's alpha)
    aux_loss_scope: Literal["batch", "sequence"] = "batch"  # balance over the batch (Switch) or per sequence (DeepSeek)
    z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE)
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k choice
    # only; after every step bias += bias_update_rate * sign(mean load - expert load). A rate > 0 implies it.
    expert_bias: bool = False  # a per-expert bias for the top-k choice only (HF e_score_correction_bias)
    bias_update_rate: float = 0.0  # aux-free balancing: bias += rate * sign(mean - load) per step (V3: 0.001)
    shared_experts: int = 0  # experts every token goes through (DeepSeekMoE)
    shared_ffn_hidden: int = 0  # hidden width of the shared experts together (0 = shared_experts x ffn_hidden)
    shared_gate: bool = False  # scale the shared experts' output by sigmoid(w . x) (Qwen2-MoE shared_expert_gate)
    ffn_hidden: int = 0  # expert hidden width (0 = the dense FFN's)
    jitter: float = 0.0  # training only: the MoE input times U(1 - jitter, 1 + jitter) (Mixtral router_jitter_noise)


@dataclass
class MambaConfig:
    """[model.mamba]: the selective state-space mixer of the "M" layers of model.layer_pattern."""

    version: int = 1  # 1 = Mamba (S6, a state per channel), 2 = Mamba-2 (SSD, a scalar decay per head)
    state: int = 16  # d_state: SSM state size (per channel for Mamba-1, per head for Mamba-2)
    conv: int = 4  # width of the causal depthwise convolution
    expand: int = 2  # inner width = expand * dim
    dt_rank: int = 0  # Mamba-1: rank of the time-step projection (0 = ceil(dim / 16))
    head_dim: int = 64  # Mamba-2: channels per SSM head (heads = inner width / head_dim)
    groups: int = 1  # Mamba-2: B/C groups shared by the heads (like grouped-query attention)
    chunk: int = 64  # the training scan's chunk length (memory vs. parallelism; not the numbers)
    conv_bias: bool = True  # a bias on the depthwise convolution
    proj_bias: bool = False  # biases on in_proj and out_proj
    dt_norm: bool = False  # RMSNorm on the time step, B and C (Jamba)
    ffn: bool = True  # Mamba layers also get the FFN/MoE sublayer (Jamba); false = the mixer alone (Mamba)


@dataclass
class MLAConfig:
    """[model.mla]: multi-head latent attention (DeepSeek-V2/V3) in place of standard attention.

    Keys and values are rebuilt from one compressed latent of ``kv_rank`` channels per token plus
    a ``rope_head_dim`` RoPE key shared by all heads; the KV cache stores only those two.
    """

    kv_rank: int = 0  # kv_lora_rank; 0 keeps standard attention
    q_rank: int = 0  # q_lora_rank: low-rank query compression (0 = one full query projection)
    rope_head_dim: int = 64  # qk_rope_head_dim: the rotated part of each query/key head
    nope_head_dim: int = 128  # qk_nope_head_dim: the unrotated part of each query/key head
    v_head_dim: int = 128  # v_head_dim: the width of each value head
    mscale: float = 0.0  # yarn mscale_all_dim: the softmax scale times (0.1 * mscale * ln(factor) + 1)^2


@dataclass
class ModelConfig:
    """Architecture of the transformer (the zoo picks components from these names)."""

    arch: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"  # causal LM, MLM encoder (BERT), seq2seq (T5)
    vocab_size: int = 2048  # embedding rows: the tokenizer's vocabulary plus sentinel_tokens
    dim: int = 128  # hidden size
    n_layers: int = 4  # transformer blocks (the encoder's, for encoder_decoder)
    n_decoder_layers: int = 0  # encoder_decoder: decoder depth (0 = n_layers)
    n_heads: int = 4  # attention (query) heads
    n_kv_heads: int = 0  # 0 means n_heads (multi-head); 1 is multi-query; else grouped-query
    head_dim: int = 0  # 0 means dim // n_heads
    ffn_hidden: int = 0  # 0 derives it from ffn_multiplier and multiple_of
    ffn_multiplier: float = 0.0  # 0 means 4x for plain FFNs and 8/3x for gated ones
    multiple_of: int = 32  # a derived ffn_hidden is rounded up to a multiple of this
    activation: Literal["swiglu", "geglu", "gelu", "gelu_tanh", "relu"] = "swiglu"  # swiglu/geglu are gated
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"  # the normalization layer everywhere
    norm_eps: float = 1e-5  # epsilon of every norm
    norm_position: Literal["pre", "post"] = "pre"  # post-norm (BERT) has no final norm
    bias: bool = False  # biases on o_proj and the FFN linears (GPT-2, BERT)
    ffn_bias: bool = False  # biases on the FFN linears also when bias is false (Llama mlp_bias)
    embed_norm: bool = False  # a norm right after the embeddings (BERT)
    type_vocab_size: int = 0  # BERT token-type embeddings (type 0 is added when none are given)
    output_dim_scale: bool = False  # multiply the final hidden by dim**-0.5 before the head (T5 v1.0)
    tie_embeddings: bool = False  # the output head shares the token-embedding weight
    max_seq_len: int = 2048  # longest sequence the position tables and caches allow
    dropout: float = 0.0  # residual and FFN dropout
    init_std: float = 0.02  # normal init std (output projections scaled down by depth)
    objective: Literal["auto", "causal_lm", "masked_lm", "span_corruption"] = "auto"  # auto follows arch
    mask_prob: float = 0.15  # masked_lm: fraction masked; span_corruption: noise density
    mean_span_length: float = 3.0  # span_corruption: mean noise-span length
    sentinel_tokens: int = 0  # ids reserved at the top of the vocab for [MASK] / T5 sentinels
    # A = attention ([model.attention], latent if [model.mla] is on), G = global attention (A without the
    # sliding window), M = Mamba ([model.mamba]); "" = all A.
    layer_pattern: str = ""  # each layer's mixer, one letter per layer, repeated to n_layers (Jamba: "MMMMAMMM")
    mtp_depth: int = 0  # multi-token prediction modules (DeepSeek-V3): module k also predicts token i + 1 + k
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    position: PositionConfig = field(default_factory=PositionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)


@dataclass
class ParallelConfig:
    """Parallel degrees; their product must equal the world size (dp_shard=-1 takes the rest)."""

    dp_replicate: int = 1  # replicas of the model (DDP, or the replicate dimension of HSDP)
    dp_shard: int = -1  # ranks sharding params, grads and optimizer state (FSDP); -1 = the processes left
    tp: int = 1  # tensor-parallel degree (Megatron-style column/row-parallel linears, vocab-parallel head)
    pp: int = 1  # pipeline stages (the outermost mesh dimension)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb"] = "1f1b"  # pipeline schedule (pp > 1)
    microbatches: int = 0  # micro-batches per pipeline step; 0 means pp
    pp_virtual_stages: int = 0  # stages per pp rank; 0 means 2 for interleaved/zero-bubble schedules, else 1
    layers_per_stage: str = ""  # block counts per stage, e.g. "3,5"; "cost": even FLOPs (head too); empty: even
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence (zigzag split)
    cp_method: Literal["allgather", "ring"] = "allgather"  # cp attention: all-gather K/V, or pass them around a ring
    ep: int = 1  # expert-parallel degree: experts sharded over this many dp_shard x cp x tp ranks
    sequence_parallel: bool = True  # with tp > 1: shard norms/dropout activations along the sequence
    reshard_after_forward: bool = True  # FSDP: true is ZeRO-3, false keeps params gathered until backward (ZeRO-2)
    cpu_offload: bool = False  # FSDP: parameters, gradients and optimizer step on the CPU
    activation_checkpoint: Literal["none", "full", "selective", "op"] = "none"  # selective = every ac_every-th block
    ac_every: int = 2  # selective: checkpoint every n-th block
    compile: Literal["auto", True, False] = "auto"  # torch.compile each block; auto: on CUDA (see README Performance)
    meta_init: bool = False  # build on the meta device, shard, then initialize (for models too big for one host)
    engine: Literal["torch", "deepspeed"] = "torch"  # torch: FSDP2/DDP/TP/PP/CP/EP; deepspeed: ZeRO data parallelism
    zero_stage: int = 2  # deepspeed: ZeRO 1 shards optimizer state, 2 also gradients, 3 also parameters
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"  # deepspeed: optimizer state and step off the GPU
    offload_params: Literal["none", "cpu", "nvme"] = "none"  # deepspeed, zero_stage 3: parameters off the GPU
    nvme_path: str = ""  # deepspeed: directory on a fast local disk for nvme offload (ZeRO-Infinity)
    deepspeed_config: str = ""  # deepspeed: a ds.json merged into the generated config; contradictions refused


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon with AdamW for the rest), its state precision, QK-clip, the schedule."""

    name: Literal["adamw", "muon"] = "adamw"  # muon: Muon on hidden matrices, AdamW on embeddings/head/norms/biases
    lr: float = 3e-4  # peak learning rate, reached after warmup_steps (with muon: the AdamW parameters')
    min_lr_ratio: float = 0.1  # the schedule's floor as a fraction of lr
    weight_decay: float = 0.1  # decoupled weight decay (Muon matrices too); none on norms, biases, embeddings
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"  # decay after warmup; wsd: warmup-stable-decay
    warmup_steps: int = 100  # linear warmup from 0 to lr
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    muon_lr: float = 0.0  # muon: peak learning rate of the Muon matrices; 0 = optim.lr (fits muon_scale=rms)
    muon_momentum: float = 0.95  # muon: momentum of the Muon matrices
    muon_nesterov: bool = True  # muon: Nesterov momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"  # muon: precision of the Newton-Schulz iteration
    muon_scale: Literal["rms", "spectral"] = "rms"  # update x 0.2*sqrt(max(out,in)) (rms) or sqrt(max(1,out/in))
    state_dtype: Literal["fp32", "bf16"] = "fp32"  # precision of the optimizer state (Adam moments, Muon momentum)
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"  # AdamW kernel; auto: fused (CPU, CUDA)
    qk_clip_threshold: float = 0.0  # QK-clip: shrink q/k weights of heads whose max attention logit exceeds it; 0 off


@dataclass
class TrainConfig:
    """The training loop: length, batch, precision, evaluation, where outputs go."""

    run_dir: str = "runs/default"  # where config, checkpoints, metrics and plots go
    steps: int = 1000  # optimizer steps to train
    batch_size: int = 8  # sequences per micro-batch, over all data-parallel ranks together
    grad_accum: int = 1  # micro-batches accumulated per optimizer step
    seq_len: int = 256  # tokens per training sequence
    seed: int = 1234  # seeds weights, data order and sampling
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # compute precision: autocast (or FSDP mixed precision)
    device: str = "auto"  # auto | cpu | cuda
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    eval_every: int = 100  # 0 disables periodic evaluation (a final one still runs)
    eval_batches: int = 8  # global batches of the validation split per evaluation
    resume: str = "auto"  # auto | none | path to a checkpoint directory
    sample_prompt: str = "def "  # prompt of the sample generated at the end of training
    sample_tokens: int = 64  # tokens generated at the end of training; 0 disables
    threads: int = 0  # torch threads per process; 0 = $OMP_NUM_THREADS, else cores / local processes
    overwrite: bool = False  # delete an existing run's outputs in run_dir and start fresh (never written as true)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # NaN/inf loss or grad norm: stop before the update, or skip it
    max_nonfinite_skips: int = 5  # on_nonfinite=skip: stop after this many skipped steps in a row
    hang_timeout_s: float = 1800.0  # no step, eval or save completes this long: dump stacks to RUN/hang/, exit; 0 off
    on_spike: Literal["off", "warn", "rollback"] = "off"  # loss/grad-norm spike: log it, or restore + skip its data
    spike_window: int = 50  # on_spike: steps in the robust window (median + k * MAD) a step is judged against
    spike_threshold: float = 6.0  # on_spike: k, the robust standard deviations above the median that make a spike
    max_rollbacks: int = 3  # on_spike=rollback: stop (exit 2) when more rollbacks than this are needed
    elastic_world: int = 0  # processes the batch is set for; fewer (elastic restart) raise grad_accum to keep it; 0 off
    fused_loss: bool = True  # head + cross-entropy in chunks: no whole (tokens x vocab) logits (torch engine)
    loss_chunk_tokens: int = 0  # tokens per chunk of the fused head + loss; 0 = 64 MiB of fp32 logits per chunk
    mtp_loss_weight: float = 0.3  # with model.mtp_depth: the loss adds this times the mean of the depths' losses
    distill_from: str = ""  # a teacher run or checkpoint directory: distill its logits into this model ("" = off)
    distill_temperature: float = 2.0  # distillation: both models' logits are divided by this before the softmax
    distill_alpha: float = 0.5  # distillation: loss = (1 - alpha) * cross-entropy + alpha * T^2 * KL(teacher||student)


@dataclass
class DataConfig:
    """Where the tokens come from and how the tokenizer is made."""

    source: str = "default"  # "default" (this Python's stdlib), a text/JSON(L)/Parquet/Arrow file or folder, or hf:NAME
    tokenizer: str = "default"  # "default"/"bpe" train SentencePiece/byte-level BPE; or .model, tokenizer.json, HF dir
    max_chars: int = 0  # cap on corpus characters read (0 = all)
    tokenizer_chars: int = 10_000_000  # characters of the corpus the default tokenizer trains on
    val_fraction: float = 0.05  # held-out share of documents when data.split is empty
    cache_dir: str = ""  # "" = $TESSERA_CACHE or ~/.cache/tessera
    blend: str = (
        ""  # prepared datasets instead of source: "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (Megatron --data-path)
    )
    blend_schedule: str = ""  # blend weights by step ranges: "0: 0.7 data/web 0.3 data/code; 90%: 1 data/hq"
    split: str = ""  # "train,valid,test" document weights, e.g. "98,1,1"; "" = from val_fraction
    text_field: str = "text"  # the field holding the text in JSON/Parquet/Arrow rows
    num_proc: int = 1  # tokenization worker processes when preparing data.source
    document_mask: bool = False  # positions restart and attention stops at document boundaries
    mask_eod_loss: bool = False  # no loss where the input token is EOD (the cross-document prediction)
    prefetch: int = 2  # batches prepared ahead by a background thread (0 = none)


@dataclass
class CheckpointConfig:
    """DCP checkpoints in the run directory."""

    enabled: bool = True  # save checkpoints at all
    every: int = 500  # steps between saves; the last step always saves
    every_minutes: float = 0.0  # also save when this many minutes passed since the last save (0 = off)
    async_save: bool = False  # write in the background (DCP async_save) while training goes on; alias "async"
    keep_last: int = 3  # older checkpoints are deleted


@dataclass
class LogConfig:
    """Console, metrics.jsonl, TensorBoard, Weights & Biases and the loss plot."""

    every: int = 10  # steps per logged record (loss and grad norm are means over them)
    straggler_ratio: float = 1.5  # flag a rank whose own time in a phase is this times its peers' median; 0 off
    progress: Literal["auto", "bar", "lines", "none"] = "auto"  # auto: a bar on a terminal, else lines
    tensorboard: bool = True  # TensorBoard events in RUN_DIR/tensorboard
    plot: bool = True  # draw RUN_DIR/loss_curve.png at the end
    peak_flops: float = 0.0  # FLOP/s per device for MFU; 0 measures (CPU, cached per machine) or looks up (GPU)
    wandb: bool = False  # also log to Weights & Biases (pip install 'tessera[wandb]')
    wandb_project: str = "tessera"  # W&B project
    wandb_run_name: str = ""  # W&B run name; "" = the run directory's name
    wandb_mode: Literal["auto", "online", "offline"] = "auto"  # auto: $WANDB_MODE, else online if logged in


@dataclass
class JobConfig:
    """A complete tessera job: the sections below, nothing else."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as nested plain data (TOML/JSON-ready)."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved config as a TOML recipe that :func:`load_config` reads back."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines += _toml_table(section, values)
        return "\n".join(lines)


def _toml_table(name: str, values: dict[str, Any]) -> list[str]:
    """``[name]`` with its scalar keys, then each sub-table as ``[name.sub]``."""
    lines = [f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
    lines.append("")
    for key, sub in values.items():
        if isinstance(sub, dict):
            lines += _toml_table(f"{name}.{key}", sub)
    return lines


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # TOML basic strings take any Unicode (emoji included)
    if isinstance(value, float):
        return repr(value)
    return str(value)


SECTIONS: dict[str, type] = typing.get_type_hints(JobConfig)

# Keys of earlier releases -> where they live now (recipes and checkpoints written before the
# [model] sub-tables keep loading). A sub-table name given a plain value sets its first key.
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
}


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_table(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` (from TOML or a CLI string) to the field type ``hint``, or fail clearly."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if True in choices and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"  # a switch with an "auto" setting: true/false from the CLI
        if value not in choices:
            opts = ", ".join(repr(c) for c in choices)
            raise ConfigError(
                f"{key} = {value!r} is not one of {opts}{_suggest(str(value), [str(c) for c in choices])}"
            )
        return value
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        raise TypeError(f"unsupported field type {hint} for {key}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise TypeError(f"unsupported field type {hint} for {key}")


def _set(config: JobConfig, dotted: str, value: Any) -> None:
    """Set ``section.key`` (or ``section.table.key``) to ``value``, coerced to the field's type."""
    if dotted in RENAMED and not isinstance(value, dict):
        dotted = RENAMED[dotted]
    section, _, rest = dotted.partition(".")
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section '{section}' in '{dotted}'{_suggest(section, list(SECTIONS))}; "
            f"sections: {', '.join(SECTIONS)}"
        )
    if not rest:
        raise ConfigError(f"config key '{dotted}' must look like section.key, e.g. model.n_layers")
    target, path = getattr(config, section), section
    *tables, name = rest.split(".")
    for table in tables:
        hint = _fields(type(target)).get(table)
        if not _is_table(hint):
            raise ConfigError(f"unknown config table '{path}.{table}' in '{dotted}'{_suggest(table, _tables(target))}")
        target, path = getattr(target, table), f"{path}.{table}"
    fields = _fields(type(target))
    if name not in fields:
        raise ConfigError(f"unknown config key '{dotted}'{_suggest(name, list(fields))}")
    if _is_table(fields[name]):
        keys = ", ".join(_fields(fields[name]))
        raise ConfigError(
            f"{dotted} is a table; set one of its keys, e.g. {dotted}.{next(iter(_fields(fields[name])))} ({keys})"
        )
    setattr(target, name, _coerce(dotted, value, fields[name]))


def _tables(target: Any) -> list[str]:
    return [k for k, hint in _fields(type(target)).items() if _is_table(hint)]


def _apply_mapping(config: JobConfig, data: dict[str, Any], where: str) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{where}: top-level key '{section}' must be a [section] table{_suggest(section, list(SECTIONS))}"
            )
        if section not in SECTIONS:
            raise ConfigError(
                f"{where}: unknown section [{section}]{_suggest(section, list(SECTIONS))}; sections: "
                f"{', '.join(SECTIONS)}"
            )
        for dotted, value in _flatten(section, values):
            _set(config, dotted, value)


def _flatten(prefix: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
    """Nested TOML tables as (dotted key, value) pairs."""
    pairs: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            pairs += _flatten(f"{prefix}.{key}", value)
        else:
            pairs.append((f"{prefix}.{key}", value))
    return pairs


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--model.dim', '64', 'train.steps=5']`` into ``[('model.dim', '64'), ('train.steps', '5')]``."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif arg.startswith("--"):
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value; write '{arg} VALUE' or '{arg[2:]}=VALUE'")
            key, value = arg[2:], args[i + 1]
            i += 1
        elif "=" in arg:
            key, value = arg.split("=", 1)
        else:
            raise ConfigError(f"cannot read override '{arg}'; write section.key=VALUE or --section.key VALUE")
        if "." not in key:
            raise ConfigError(f"override '{arg}' must name section.key, e.g. --model.n_layers 4")
        pairs.append((key, value))
        i += 1
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Load a TOML recipe (or the defaults when ``path`` is None), apply overrides, validate."""
    config = JobConfig()
    if path is not None:
        _apply_mapping(config, _read_toml(Path(path)), str(path))
    for key, value in parse_overrides(overrides or []):
        _set(config, key, value)
    validate(config)
    return config


def apply_overrides(config: JobConfig, overrides: list[str]) -> JobConfig:
    """``config`` with dotted ``overrides`` (as on the command line) applied, then validated."""
    for key, value in parse_overrides(overrides):
        _set(config, key, value)
    validate(config)
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML recipe; every way the file can be unreadable is one ConfigError."""
    if path.is_dir():
        raise ConfigError(f"config path '{path}' is a directory; pass a TOML recipe such as configs/smoke.toml")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass a TOML recipe such as configs/smoke.toml")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text (byte {err.start} is invalid); pass a TOML recipe"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read ({err.strerror})") from None


def config_from_dict(data: dict[str, Any], where: str = "config") -> JobConfig:
    """Build and validate a JobConfig from nested plain data (e.g. a checkpoint's config.json)."""
    config = JobConfig()
    _apply_mapping(config, data, where)
    validate(config)
    return config


def model_config(**keys: Any) -> ModelConfig:
    """A ModelConfig from keyword arguments: top-level keys, sub-table keys as dicts
    (``moe={"experts": 4}``) or the flat names of earlier releases (``moe_experts=4``)."""
    config = JobConfig()
    _apply_mapping(config, {"model": keys}, "model config")
    return config.model


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_all(section: str, obj: Any, keys: tuple[str, ...], positive: bool) -> None:
    """Each ``section.key`` is > 0 (``positive``) or >= 0."""
    for key in keys:
        value = getattr(obj, key)
        ok = value > 0 if positive else value >= 0
        _require(ok, f"{section}.{key} must be {'positive' if positive else '>= 0'}, got {value}")


def validate_model(m: ModelConfig) -> None:
    """The [model] checks alone (also for configs that come from elsewhere, e.g. an HF checkpoint)."""
    _require_finite("model", m)
    _require_all("model", m, ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"), positive=True)
    _require_all(
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
    _require(
        m.head_dim > 0 or m.dim % m.n_heads == 0,
        f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; pick a dim that is a multiple of n_heads "
        "or set model.head_dim",
    )
    kv = m.n_kv_heads or m.n_heads
    _require(
        m.n_heads % kv == 0,
        f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={kv}; use a divisor of n_heads",
    )
    _require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")
    _require(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    _require(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    _require(0.0 < m.mask_prob < 1.0, f"model.mask_prob must be in (0, 1), got {m.mask_prob}")
    _require(m.mean_span_length >= 1.0, f"model.mean_span_length must be >= 1, got {m.mean_span_length}")
    _require(m.mtp_depth >= 0, f"model.mtp_depth must be >= 0, got {m.mtp_depth}")
    _require(
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
    _require_all("model.attention", a, ("sliding_window", "global_tokens", "scale"), positive=False)
    _require_all("model.attention", a, ("block_size", "random_blocks", "performer_features"), positive=True)
    _require(0.0 <= a.dropout < 1.0, f"model.attention.dropout must be in [0, 1), got {a.dropout}")
    linear = a.kernel in ("linear", "performer")
    _require(
        not linear or m.position.kind in ("rope", "learned", "sinusoidal", "none"),
        f"model.attention.kernel='{a.kernel}' cannot add a score bias; model.position.kind='{m.position.kind}' needs "
        "a softmax kernel (sdpa or eager)",
    )
    _require(
        not linear or a.sliding_window == 0,
        f"model.attention.sliding_window needs a softmax kernel, not model.attention.kernel='{a.kernel}'",
    )
    _require(
        a.kernel != "longformer" or a.sliding_window > 0,
        "model.attention.kernel='longformer' needs model.attention.sliding_window > 0 (the local width)",
    )


def layer_heads(m: ModelConfig) -> list[int]:
    """Query heads of each layer: ``model.attention.heads_per_layer``, or ``model.n_heads`` everywhere."""
    spec = m.attention.heads_per_layer
    return [int(c) for c in spec.split(",")] if spec else [m.n_heads] * m.n_layers


def _validate_heads_per_layer(m: ModelConfig) -> None:
    """Per-layer head counts: whole GQA groups of the standard attention of a decoder or encoder."""
    spec = m.attention.heads_per_layer
    if not spec:
        return
    key = f"model.attention.heads_per_layer={m.attention.heads_per_layer!r}"
    counts = spec.split(",")
    _require(
        all(c.strip().isdigit() for c in counts) and len(counts) == m.n_layers,
        f"{key} must be {m.n_layers} comma-separated head counts, one per layer (model.n_layers)",
    )
    group = m.n_heads // (m.n_kv_heads or m.n_heads)
    _require(
        all(1 <= int(c) <= m.n_heads and int(c) % group == 0 for c in counts),
        f"{key}: each count must be a multiple of the GQA group size n_heads/n_kv_heads={group} in [{group}, "
        f"{m.n_heads}]",
    )
    refused = [
        (m.arch == "encoder_decoder", "arch='encoder_decoder'"),
        (m.position.kind in ("t5_bias", "alibi"), f"position.kind='{m.position.kind}' (a bias per head)"),
        (m.mla.kv_rank > 0, "model.mla (latent attention)"),
        ("M" in m.layer_pattern, "Mamba layers"),
    ]
    unsupported = next((name for hit, name in refused if hit), "")
    _require(
        not unsupported,
        f"{key} is not supported with {unsupported}; per-layer head counts need a decoder or "
        "encoder of standard attention layers without per-head position biases",
    )


def _validate_position(m: ModelConfig) -> None:
    pos = m.position
    _require_all("model.position", pos, ("rel_buckets", "rel_max_distance"), positive=True)
    _require_all("model.position", pos, ("rope_original_max_len",), positive=False)
    _require(pos.rope_theta > 0, f"model.position.rope_theta must be positive, got {pos.rope_theta}")
    head_dim = m.mla.rope_head_dim if m.mla.kv_rank else m.head_dim or m.dim // m.n_heads
    rot = int(head_dim * pos.rotary_fraction)
    _require(
        0.0 < pos.rotary_fraction <= 1.0, f"model.position.rotary_fraction must be in (0, 1], got {pos.rotary_fraction}"
    )
    _require(
        pos.kind != "rope" or (rot > 0 and rot % 2 == 0),
        "model.position.kind='rope' needs an even rotary width, got "
        f"head_dim*rotary_fraction={head_dim * pos.rotary_fraction:g}; change model.position.rotary_fraction or "
        "model.head_dim",
    )
    _require(
        pos.rope_scaling_factor >= 1.0,
        f"model.position.rope_scaling_factor must be >= 1, got {pos.rope_scaling_factor}",
    )
    _require(
        pos.rope_scaling != "llama3" or 0 < pos.rope_low_freq_factor < pos.rope_high_freq_factor,
        "model.position.rope_low_freq_factor must be positive and below model.position.rope_high_freq_factor, got "
        f"{pos.rope_low_freq_factor} and {pos.rope_high_freq_factor}",
    )
    _require(
        pos.rope_attention_factor >= 0,
        f"model.position.rope_attention_factor must be >= 0, got {pos.rope_attention_factor}",
    )
    _require(
        pos.rel_buckets % 2 == 0 and pos.rel_buckets >= 4,
        f"model.position.rel_buckets must be an even number >= 4, got {pos.rel_buckets}",
    )
    _require(
        m.arch != "encoder_decoder" or pos.kind != "alibi",
        "model.position.kind='alibi' is not supported for arch='encoder_decoder'",
    )


def _validate_moe(moe: MoEConfig) -> None:
    _require_all("model.moe", moe, ("experts", "shared_experts", "ffn_hidden", "first_dense"), positive=False)
    _require_all("model.moe", moe, ("shared_ffn_hidden", "bias_update_rate"), positive=False)
    _require_all("model.moe", moe, ("every", "groups", "topk_groups", "route_scale"), positive=True)
    if not moe.experts:
        return
    _require(
        1 <= moe.top_k <= moe.experts, f"model.moe.top_k={moe.top_k} must be in [1, model.moe.experts={moe.experts}]"
    )
    _require(
        moe.capacity_factor >= 0, f"model.moe.capacity_factor must be >= 0 (0 = dropless), got {moe.capacity_factor}"
    )
    _require(
        moe.aux_loss_coef >= 0 and moe.z_loss_coef >= 0,
        "model.moe.aux_loss_coef and model.moe.z_loss_coef must be >= 0",
    )
    _require(
        moe.experts % moe.groups == 0,
        f"model.moe.groups={moe.groups} must divide model.moe.experts={moe.experts} (equal expert groups)",
    )
    per_group = moe.experts // moe.groups
    _require(
        moe.topk_groups <= moe.groups and moe.top_k <= moe.topk_groups * per_group,
        f"model.moe.topk_groups={moe.topk_groups} groups of {per_group} experts cannot hold top_k={moe.top_k}; "
        f"use topk_groups in [1, groups={moe.groups}] with topk_groups * experts / groups >= top_k",
    )
    _require(
        not moe.shared_gate or moe.shared_experts > 0,
        "model.moe.shared_gate gates the shared experts; set model.moe.shared_experts > 0",
    )


LAYER_KINDS = {"A": "attention", "G": "global attention", "M": "Mamba"}


def _validate_mixers(m: ModelConfig) -> None:
    """model.layer_pattern, [model.mamba] and [model.mla]."""
    pattern = m.layer_pattern
    bad = sorted(set(pattern) - set(LAYER_KINDS))
    _require(
        not bad,
        f"model.layer_pattern={pattern!r} has {bad[0]!r}; use one letter per layer: "
        + ", ".join(f"{k} ({v})" for k, v in LAYER_KINDS.items())
        if bad
        else "",
    )
    _require(
        not pattern or m.n_layers % len(pattern) == 0,
        f"model.layer_pattern has {len(pattern)} letters, which do not tile model.n_layers={m.n_layers}; use a "
        "divisor of n_layers letters",
    )
    _require(
        m.arch == "decoder" or not (set(pattern) - {"A"} or m.mla.kv_rank),
        f"model.layer_pattern and model.mla are for decoders, not model.arch='{m.arch}'",
    )
    _require(
        "G" not in pattern or (m.attention.sliding_window > 0 and m.attention.kernel in ("sdpa", "eager")),
        "model.layer_pattern 'G' (global attention) needs model.attention.sliding_window > 0 and the sdpa or "
        "eager kernel",
    )
    if "M" in pattern:
        _validate_mamba(m)
    mla = m.mla
    if mla.kv_rank:
        _require_all("model.mla", mla, ("rope_head_dim", "v_head_dim"), positive=True)
        _require_all("model.mla", mla, ("q_rank", "nope_head_dim", "mscale"), positive=False)
        _require(
            m.position.kind == "rope" and m.attention.kernel in ("sdpa", "eager"),
            "model.mla needs model.position.kind='rope' and model.attention.kernel sdpa or eager",
        )
    _require(0.0 <= m.moe.jitter < 1.0, f"model.moe.jitter must be in [0, 1), got {m.moe.jitter}")


def _validate_mamba(m: ModelConfig) -> None:
    mamba = m.mamba
    _require(mamba.version in (1, 2), f"model.mamba.version must be 1 or 2, got {mamba.version}")
    _require_all("model.mamba", mamba, ("state", "conv", "expand", "head_dim", "groups", "chunk"), positive=True)
    _require_all("model.mamba", mamba, ("dt_rank",), positive=False)
    _require(
        mamba.version == 1 or not mamba.dt_norm, "model.mamba.dt_norm (Jamba) is a Mamba-1 option; set version = 1"
    )
    if mamba.version == 2:
        inner = mamba.expand * m.dim
        _require(
            inner % mamba.head_dim == 0 and (inner // mamba.head_dim) % mamba.groups == 0,
            f"model.mamba: the inner width expand*dim={inner} must split into heads of head_dim={mamba.head_dim}, "
            f"and the heads into groups={mamba.groups}",
        )


def _validate_objective(m: ModelConfig, t: TrainConfig) -> None:
    """The training objective fits the architecture and has its reserved token ids."""
    objective = resolved_objective(m)
    wanted = {"causal_lm": "decoder", "masked_lm": "encoder", "span_corruption": "encoder_decoder"}[objective]
    _require(m.arch == wanted, f"model.objective='{objective}' trains arch='{wanted}', not model.arch='{m.arch}'")
    needed = {
        "causal_lm": 0,
        "masked_lm": 1,
        "span_corruption": span_count(t.seq_len + 1, m.mask_prob, m.mean_span_length),
    }[objective]
    _require(
        m.sentinel_tokens >= needed,
        f"model.objective='{objective}' with train.seq_len={t.seq_len} needs model.sentinel_tokens >= {needed} (ids "
        f"reserved at the top of the vocab), got {m.sentinel_tokens}",
    )
    _require(
        m.vocab_size > m.sentinel_tokens,
        f"model.sentinel_tokens={m.sentinel_tokens} leaves no ids of model.vocab_size={m.vocab_size} for the tokenizer",
    )


def resolved_objective(m: ModelConfig) -> str:
    """``model.objective`` with "auto" replaced by the arch's natural objective."""
    if m.objective != "auto":
        return m.objective
    return {"decoder": "causal_lm", "encoder": "masked_lm", "encoder_decoder": "span_corruption"}[m.arch]


def span_count(length: int, density: float, mean_span: float) -> int:
    """How many noise spans T5 span corruption cuts into ``length`` tokens (one sentinel each)."""
    noise = min(max(round(length * density), 1), length - 1)
    return max(round(noise / mean_span), 1)


def _require_finite(prefix: str, obj: Any) -> None:
    """Every float field under ``obj`` is a finite number (NaN and infinity pass most range checks)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _require_finite(f"{prefix}.{f.name}", value)
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{prefix}.{f.name} must be a finite number, got {value}")


def validate(config: JobConfig) -> None:
    """Cross-field checks: everything that can be known wrong before a process starts."""
    validate_model(config.model)
    for section in SECTIONS:
        _require_finite(section, getattr(config, section))
    _validate_objective(config.model, config.train)
    _validate_train(config.train, config.model)
    _validate_optim(config.optim, config.train)
    _validate_qk_clip(config.optim, config.model)
    check_layout(config)
    _validate_data(config.data)
    _validate_engine(config.parallel, config.train)
    _validate_engine_optimizer(config.parallel, config.optim)
    _require(
        not (config.data.document_mask and "M" in config.model.layer_pattern),
        "data.document_mask cannot reset Mamba layers' state at document boundaries; set data.document_mask=false "
        "or use attention layers only",
    )
    _validate_blend_schedule(config.data.blend_schedule, config.train.steps)
    _validate_output(config)


def _validate_train(t: TrainConfig, m: ModelConfig) -> None:
    _require_all("train", t, ("steps", "batch_size", "grad_accum", "seq_len", "eval_batches"), positive=True)
    _require_all("train", t, ("eval_every", "sample_tokens", "loss_chunk_tokens"), positive=False)
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len or shorten "
        "train.seq_len",
    )
    _require(0.0 <= t.label_smoothing < 1.0, f"train.label_smoothing must be in [0, 1), got {t.label_smoothing}")
    _require(
        t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"),
        f"train.device={t.device!r} must be auto, cpu or cuda",
    )
    _require(t.threads >= 0, f"train.threads must be >= 0 (0 = auto), got {t.threads}")
    _require(t.mtp_loss_weight >= 0, f"train.mtp_loss_weight must be >= 0, got {t.mtp_loss_weight}")
    _require(t.distill_temperature > 0, f"train.distill_temperature must be positive, got {t.distill_temperature}")
    _require(0.0 <= t.distill_alpha <= 1.0, f"train.distill_alpha must be in [0, 1], got {t.distill_alpha}")
    _require(
        not t.distill_from or resolved_objective(m) == "causal_lm",
        f"train.distill_from distills a causal LM; model.objective is {resolved_objective(m)!r}",
    )
    _require(bool(t.run_dir), "train.run_dir must not be empty")
    _require(0 <= t.seed < 2**32, f"train.seed must be in [0, 2**32) (numpy and megatron seeds), got {t.seed}")
    _require(t.max_nonfinite_skips >= 1, f"train.max_nonfinite_skips must be >= 1, got {t.max_nonfinite_skips}")
    _require(t.hang_timeout_s >= 0, f"train.hang_timeout_s must be >= 0 (0 = no watchdog), got {t.hang_timeout_s}")
    _validate_spike(t)


def _validate_spike(t: TrainConfig) -> None:
    _require(5 <= t.spike_window <= 100_000, f"train.spike_window must be in [5, 100000] steps, got {t.spike_window}")
    _require(
        1.0 <= t.spike_threshold <= 100.0,
        f"train.spike_threshold must be in [1, 100] (robust standard deviations; 6 is a good start), got "
        f"{t.spike_threshold}",
    )
    _require(t.max_rollbacks >= 1, f"train.max_rollbacks must be >= 1, got {t.max_rollbacks}")
    _require(t.elastic_world >= 0, f"train.elastic_world must be >= 0 (0 = not elastic), got {t.elastic_world}")


def _validate_optim(o: OptimConfig, t: TrainConfig) -> None:
    _require(o.lr > 0, f"optim.lr must be positive, got {o.lr}")
    _require(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _require(
        0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0, f"optim.beta1/beta2 must be in [0, 1), got {o.beta1}, {o.beta2}"
    )
    _require(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _require(
        o.warmup_steps <= t.steps,
        f"optim.warmup_steps={o.warmup_steps} is longer than train.steps={t.steps}; shorten the warmup or train longer",
    )
    _require(0.0 < o.decay_fraction <= 1.0, f"optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    _require(o.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {o.grad_clip}")
    _require(o.eps > 0, f"optim.eps must be positive (AdamW divides by sqrt(v) + eps), got {o.eps}")
    _require(o.muon_lr >= 0, f"optim.muon_lr must be >= 0 (0 = optim.lr), got {o.muon_lr}")
    _require(0.0 <= o.muon_momentum < 1.0, f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    _require(1 <= o.muon_ns_steps < 100, f"optim.muon_ns_steps must be in [1, 99], got {o.muon_ns_steps}")
    _require(o.qk_clip_threshold >= 0, f"optim.qk_clip_threshold must be >= 0 (0 disables), got {o.qk_clip_threshold}")
    _require(
        o.implementation == "auto" or o.state_dtype == "fp32",
        f"optim.implementation={o.implementation!r} picks torch's AdamW kernel, which keeps fp32 moments; "
        "optim.state_dtype='bf16' runs tessera's own update: set optim.implementation='auto'",
    )


def _validate_qk_clip(o: OptimConfig, m: ModelConfig) -> None:
    if o.qk_clip_threshold <= 0:
        return
    _require(
        not m.attention.qk_norm,
        "optim.qk_clip_threshold rescales q/k projections, which model.attention.qk_norm would undo; "
        "set one of them off",
    )
    _require(not m.mla.kv_rank, "optim.qk_clip_threshold supports standard attention, not [model.mla]; set it to 0")
    _require(
        m.attention.kernel not in ("linear", "performer"),
        f"optim.qk_clip_threshold needs softmax attention logits, not model.attention.kernel='{m.attention.kernel}'",
    )


def _validate_engine_optimizer(p: ParallelConfig, o: OptimConfig) -> None:
    """DeepSpeed runs its own AdamW: tessera's Muon, bf16 state and QK-clip live in the torch engine."""
    if p.engine != "deepspeed":
        return
    used_keys = {"name": o.name != "adamw", "state_dtype": o.state_dtype != "fp32"}
    used_keys["implementation"] = o.implementation != "auto"
    for key, used in used_keys.items():
        _require(
            not used, f"optim.{key}={getattr(o, key)!r} needs parallel.engine='torch' (DeepSpeed runs its own AdamW)"
        )
    _require(
        o.qk_clip_threshold == 0, "optim.qk_clip_threshold needs parallel.engine='torch'; set it to 0 for DeepSpeed"
    )


def _validate_engine(p: ParallelConfig, t: TrainConfig) -> None:
    """The DeepSpeed keys (the layouts the engine refuses are in the compatibility table)."""
    _require(
        p.engine == "torch" or t.on_nonfinite == "stop",
        "train.on_nonfinite=skip cannot hold back a DeepSpeed step (it reduces, clips and updates in one call); "
        "set train.on_nonfinite=stop or parallel.engine='torch'",
    )
    deepspeed_only = {"offload_optimizer": p.offload_optimizer != "none", "offload_params": p.offload_params != "none"}
    deepspeed_only.update(nvme_path=bool(p.nvme_path), deepspeed_config=bool(p.deepspeed_config))
    for key, used in deepspeed_only.items():
        _require(not used or p.engine == "deepspeed", f"parallel.{key} needs parallel.engine='deepspeed'")
    _require(p.zero_stage in (1, 2, 3), f"parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}")
    _require(
        p.offload_params == "none" or p.zero_stage == 3,
        f"parallel.offload_params={p.offload_params!r} needs parallel.zero_stage=3 (only ZeRO-3 partitions parameters)",
    )
    _require(
        "nvme" not in (p.offload_optimizer, p.offload_params) or bool(p.nvme_path),
        "nvme offload needs parallel.nvme_path = a directory on a fast local disk",
    )
    if p.deepspeed_config:
        path = Path(p.deepspeed_config)
        _require(path.is_file(), f"parallel.deepspeed_config='{path}' does not exist; give the path of a ds.json")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"parallel.deepspeed_config='{path}' is not valid JSON ({err})") from None
        _require(isinstance(data, dict), f"parallel.deepspeed_config='{path}' must hold a JSON object")


def _validate_data(d: DataConfig) -> None:
    _require(0.0 <= d.val_fraction < 0.5, f"data.val_fraction must be in [0, 0.5), got {d.val_fraction}")
    _require(d.max_chars >= 0, f"data.max_chars must be >= 0 (0 = all), got {d.max_chars}")
    _require(d.tokenizer_chars > 0, f"data.tokenizer_chars must be positive, got {d.tokenizer_chars}")
    _require(d.num_proc >= 1, f"data.num_proc must be >= 1, got {d.num_proc}")
    _require(d.prefetch >= 0, f"data.prefetch must be >= 0 (0 = no background thread), got {d.prefetch}")
    _require(bool(d.text_field), "data.text_field must name the field that holds the text, e.g. 'text'")
    _require(
        not d.split or re.fullmatch(r"\d+(\.\d*)?(,\d+(\.\d*)?){0,2}", d.split.replace(" ", "")) is not None,
        f"data.split={d.split!r} must be up to three comma-separated numbers train,valid,test, e.g. '98,1,1'",
    )
    _require(
        not (d.blend and d.source != "default"),
        "data.blend and data.source are both set; use data.source for raw text or data.blend for prepared datasets, "
        "not both",
    )
    _require(
        not (d.blend or d.blend_schedule) or d.tokenizer not in ("default", "bpe"),
        "data.blend and data.blend_schedule need data.tokenizer = the tokenizer the datasets were prepared with "
        "(.model, tokenizer.json or HF directory)",
    )
    _require(
        not (d.blend_schedule and (d.blend or d.source != "default")),
        "data.blend_schedule names its datasets itself; leave data.blend and data.source unset",
    )


def _validate_blend_schedule(schedule: str, steps: int) -> None:
    if schedule:
        from tessera.data.mixture import parse_blend_schedule  # pure parsing (no torch, no data files)
        from tessera.data.sources import DataError

        try:
            parse_blend_schedule(schedule, steps)
        except DataError as err:
            raise ConfigError(str(err)) from None


def _validate_output(config: JobConfig) -> None:
    c, log = config.checkpoint, config.log
    _require(c.every > 0, f"checkpoint.every must be positive, got {c.every}")
    _require(c.every_minutes >= 0, f"checkpoint.every_minutes must be >= 0 (0 = off), got {c.every_minutes}")
    _require(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    _require(
        config.train.on_spike != "rollback" or c.enabled,
        "train.on_spike=rollback restores a checkpoint but checkpoint.enabled=false; enable checkpoints or set "
        "train.on_spike=warn",
    )
    _require(log.every > 0, f"log.every must be positive, got {log.every}")
    _require(
        log.straggler_ratio == 0 or 1.0 < log.straggler_ratio <= 100.0,
        f"log.straggler_ratio must be 0 (off) or in (1, 100], got {log.straggler_ratio}",
    )
    _require(log.peak_flops >= 0, f"log.peak_flops must be >= 0, got {log.peak_flops}")
