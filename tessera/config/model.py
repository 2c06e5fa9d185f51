"""[model]: the architecture sections (attention, position, MoE, Mamba, latent attention) and what
their keys mean when read together (per-layer heads, the resolved objective)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AttentionConfig:
    """[model.attention]: the attention kernel and its options."""

    kernel: str = "sdpa"  # a registered kernel (docs/reference/components.md): sdpa, eager (fp32 softmax), ...
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
    softcap: float = 0.0  # > 0: scores = cap * tanh(scores / cap) before the mask (Gemma 2 attn_logit_softcapping)
    sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss attention sinks)
    heads_per_layer: str = ""  # query heads per layer, e.g. "4,2,4,2" (pruned models); "" = n_heads in every layer
    output_gate: bool = False  # gated attention (Qwen3-Next): the output times sigmoid(a per-head gate from q_proj)
    # Llama 4 (docs/layer-patterns.md): chunked 'A' layers, L2-normed q/k on RoPE layers, tuned NoPE temperatures.
    chunk_size: int = 0  # > 0: 'A' layers attend causally within fixed chunks of this many positions (Llama 4)
    qk_l2_norm: bool = False  # weightless RMS norm of each head's q and k on the RoPE layers (Llama 4 use_qk_norm)
    temperature_tuning: bool = False  # NoPE layers: q *= log(floor((pos + 1) / floor) + 1) * scale + 1 (Llama 4)
    temperature_floor: int = 8192  # temperature tuning: positions per step of the log (HF floor_scale)
    temperature_scale: float = 0.1  # temperature tuning: the log's weight (HF attn_scale)


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
    rope_yarn_truncate: bool = True  # yarn: round the blend's dimension range to integers (HF truncate; gpt-oss false)
    rotary_fraction: float = 1.0  # partial rotary: the leading fraction of each head rotated
    # Per-layer RoPE (docs/layer-patterns.md): the sliding-window 'A' layers of a layer_pattern with 'G' layers may
    # have their own plain RoPE (no rope_scaling): Gemma 3 10000 (global 1e6, scaled), OLMo 3 rope_theta unscaled.
    local_rope_theta: float = 0.0  # RoPE base of the local 'A' layers, unscaled; 0 = the same RoPE in every layer
    nope_layers: str = ""  # layers without rotary (NoPE), comma-separated indices "3,7,11" (SmolLM3, Llama 4 iRoPE)
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
    # global: the balance loss of the global micro-batch (dp x cp ranks' tokens; every layout trains the same
    # model); micro: this rank's micro-batch (Megatron/torchtitan's per-rank loss); sequence: each (DeepSeek)
    aux_loss_scope: Literal["global", "micro", "sequence"] = "global"  # all dp ranks | this rank | each sequence
    capacity_scope: Literal["global", "micro"] = "global"  # expert capacity of the global or this rank's micro-batch
    z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE)
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k choice
    # only; after every step bias += bias_update_rate * sign(mean load - expert load). A rate > 0 implies it.
    expert_bias: bool = False  # a per-expert bias for the top-k choice only (HF e_score_correction_bias)
    bias_update_rate: float = 0.0  # aux-free balancing: bias += rate * sign(mean - load) per step (V3: 0.001)
    shared_experts: int = 0  # experts every token goes through (DeepSeekMoE)
    shared_ffn_hidden: int = 0  # hidden width of the shared experts together (0 = shared_experts x ffn_hidden)
    shared_gate: bool = False  # scale the shared experts' output by sigmoid(w . x) (Qwen2-MoE shared_expert_gate)
    ffn_hidden: int = 0  # expert hidden width (0 = the dense FFN's)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_biases: bool = False  # biases on every expert projection (gpt-oss)
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU, (clamp(up)+1) g sigmoid(1.702 g), g = min(gate, limit)
    scale_input: bool = False  # routing weights scale each expert's input instead of its output (Llama 4)
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
    dt_min: float = 0.0  # Mamba-2: floor of each time step after its softplus (Nemotron-H's time_step_min; 0 = none)


@dataclass
class GatedDeltaNetConfig:
    """[model.gdn]: the Gated DeltaNet mixer (Yang et al. 2025, Qwen3-Next) of the "D" layers of model.layer_pattern."""

    key_heads: int = 4  # query/key heads (linear_num_key_heads)
    value_heads: int = 8  # value heads, a multiple of key_heads (linear_num_value_heads)
    key_head_dim: int = 32  # channels per query/key head (linear_key_head_dim)
    value_head_dim: int = 32  # channels per value head (linear_value_head_dim)
    conv: int = 4  # width of the causal depthwise convolution on q, k, v (linear_conv_kernel_dim)
    chunk: int = 64  # the training form's chunk length (memory vs. parallelism; not the numbers)


@dataclass
class KimiDeltaConfig:
    """[model.kda]: Kimi Delta Attention (Kimi Linear): the delta rule with a decay per key channel, in the "K"
    layers of model.layer_pattern."""

    heads: int = 4  # heads, each with a (head_dim x head_dim) state (linear_attn_config.num_heads)
    head_dim: int = 32  # channels per q/k/v head; also the rank of the decay and gate projections (head_dim)
    conv: int = 4  # width of the causal depthwise convolution on q, k, v (short_conv_kernel_size)
    chunk: int = 64  # the training form's chunk length (memory vs. parallelism; not the numbers)


@dataclass
class HybridConfig:
    """[model.hybrid]: the parallel hybrid mixer of the "H" layers of model.layer_pattern (Falcon-H1): attention
    ([model.attention], the model's heads) and Mamba-2 ([model.mamba]) side by side on the same normed input, their
    outputs scaled and summed. The multipliers are Falcon-H1's muP factors (HF's names in brackets)."""

    mamba_inner: int = 0  # the Mamba-2 inner width (mamba_d_ssm); 0 = model.mamba.expand * dim
    gated_norm: bool = False  # the Mamba-2 output's gated RMSNorm (mamba_rms_norm); false = y * silu(z) alone
    norm_before_gate: bool = True  # gated_norm: norm(y) * silu(z) (true) or norm(y * silu(z)) (mamba_norm_before_gate)
    attention_in: float = 1.0  # the attention input times this (attention_in_multiplier)
    attention_out: float = 1.0  # the attention output times this (attention_out_multiplier)
    key: float = 1.0  # the keys times this, before RoPE (key_multiplier)
    ssm_in: float = 1.0  # the Mamba input times this (ssm_in_multiplier)
    ssm_out: float = 1.0  # the Mamba output times this (ssm_out_multiplier)
    ssm_z: float = 1.0  # the gate z of in_proj's output times this (ssm_multipliers[0])
    ssm_x: float = 1.0  # the SSM input x times this (ssm_multipliers[1])
    ssm_b: float = 1.0  # B times this (ssm_multipliers[2])
    ssm_c: float = 1.0  # C times this (ssm_multipliers[3])
    ssm_dt: float = 1.0  # the time step's pre-activation times this (ssm_multipliers[4])


@dataclass
class MupConfig:
    """[model.mup]: muP multipliers outside the mixers (Falcon-H1's; 1.0 = off)."""

    embedding: float = 1.0  # token embeddings times this (embedding_multiplier)
    head: float = 1.0  # the logits times this, applied to the final norm's output (lm_head_multiplier)
    ffn_gate: float = 1.0  # a gated FFN's gate projection times this before the activation (mlp_multipliers[0])
    ffn_down: float = 1.0  # the FFN's output times this (mlp_multipliers[1])


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
    norm_eps: float = 0.0  # epsilon of the latent RMSNorms (kv_a, q_a); 0 = model.norm_eps (Kimi Linear: 1e-6)


@dataclass
class DSAConfig:
    """[model.dsa]: DeepSeek Sparse Attention (DeepSeek-V3.2) on top of [model.mla].

    A lightning indexer scores every key for each query; the query attends to its ``topk`` best. The
    indexer learns from a KL term against the main attention's distribution (its inputs detached).
    """

    topk: int = 0  # index_topk: keys each query attends to; 0 keeps dense latent attention
    index_heads: int = 64  # index_n_heads
    index_head_dim: int = 128  # index_head_dim (its first rope_head_dim channels are rotated)
    stage: Literal["warmup", "sparse"] = "sparse"  # warmup: dense attention, only the indexer trains
    indexer_loss_coef: float = 1.0  # weight of the indexer's KL loss (its gradient reaches only the indexer)


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
    activation: Literal["swiglu", "geglu", "gelu", "gelu_tanh", "relu", "relu2"] = "swiglu"  # swiglu/geglu gated
    # zero_centered_rmsnorm: RMSNorm with gain 1 + weight, weight initialized to 0 (Qwen3-Next, Gemma)
    norm: Literal["rmsnorm", "layernorm", "zero_centered_rmsnorm"] = "rmsnorm"  # the normalization layer everywhere
    norm_eps: float = 1e-5  # epsilon of every norm
    # pre: x + f(norm(x)) (Llama); post: norm(x + f(x)) (BERT, no final norm); sandwich: x + post(f(norm(x)))
    # (Gemma 2/3: pre- and post-sublayer norms); reordered: x + norm(f(x)) (OLMo 2/3: the sublayer output normed)
    norm_position: Literal["pre", "post", "sandwich", "reordered"] = "pre"  # where each sublayer's norm sits
    bias: bool = False  # biases on o_proj and the FFN linears (GPT-2, BERT)
    ffn_bias: bool = False  # biases on the FFN linears also when bias is false (Llama mlp_bias)
    embed_norm: bool = False  # a norm right after the embeddings (BERT)
    embed_scale: bool = False  # token embeddings times sqrt(dim), rounded to the embedding dtype (Gemma)
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap) (Gemma 2 final_logit_softcapping)
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
    # sliding window), M = Mamba ([model.mamba]), D = Gated DeltaNet ([model.gdn]), K = Kimi Delta Attention
    # ([model.kda]), H = attention and Mamba-2 in parallel ([model.hybrid], Falcon-H1); "" = all A.
    layer_pattern: str = ""  # each layer's mixer, one letter per layer, repeated to n_layers (Jamba: "MMMMAMMM")
    mtp_depth: int = 0  # multi-token prediction modules (DeepSeek-V3): module k also predicts token i + 1 + k
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    position: PositionConfig = field(default_factory=PositionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    dsa: DSAConfig = field(default_factory=DSAConfig)
    gdn: GatedDeltaNetConfig = field(default_factory=GatedDeltaNetConfig)
    kda: KimiDeltaConfig = field(default_factory=KimiDeltaConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    mup: MupConfig = field(default_factory=MupConfig)


def layer_heads(m: ModelConfig) -> list[int]:
    """Query heads of each layer: ``model.attention.heads_per_layer``, or ``model.n_heads`` everywhere."""
    spec = m.attention.heads_per_layer
    return [int(c) for c in spec.split(",")] if spec else [m.n_heads] * m.n_layers


def resolved_objective(m: ModelConfig) -> str:
    """``model.objective`` with "auto" replaced by the arch's natural objective."""
    if m.objective != "auto":
        return m.objective
    return {"decoder": "causal_lm", "encoder": "masked_lm", "encoder_decoder": "span_corruption"}[m.arch]
