"""FLOPs of one training sample, counted from the modules that run (not from 6 N).

The zoo model is built on the meta device and walked: every ``nn.Linear`` costs 2 x its weight per
token it sees (cross-attention's k/v see the encoder's tokens), a MoE layer's experts only for the
top-k assignments of each token (dropless; shared experts and the router for every token), a Mamba
layer its depthwise convolution and its scan's contractions, an attention layer its score and value
products over the (query, key) pairs, and the output head once per prediction depth (MTP included).

Two counts of every term:

- ``executed``: what the kernels tessera runs compute, the count ``torch.utils.flop_counter``
  reports: a dense or masked sdpa scores every (query, key) pair (the CPU kernel and the math path
  skip nothing), the block-sparse windowed kernels only their blocks, a chunked delta rule its padded
  chunks, the convolution its (left-padded) output;
- ``model``: the useful work, for MFU: causal attention over the keys each query may see
  (T (T + 1) / 2 pairs, a sliding window ``min(i + 1, w)``, Longformer/BigBird their pattern); the
  causal convolutions are padded on the left only, so both counts are one output per position.

Training is forward + backward = 3 x forward (backward computes the input and the weight gradient of
every product; FlashAttention's backward also recomputes the scores, +0.5 x the attention forward,
which this convention leaves out). Activation checkpointing re-runs the forward of the blocks it
wraps: "hardware" FLOPs add that recompute, "model" FLOPs never do. Softmax, norms, activations, the
loss and a Mamba scan's elementwise recurrence are not counted (FlopCounterMode counts only matmul,
convolution and attention ops; at tessera's shapes they are a few percent of the total).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import dataclasses
import math

import torch
from torch import nn

from tessera.config import ModelConfig, resolved_objective
from tessera.data.objectives import span_count
from tessera.model import build_model
from tessera.model.attention import LINEAR_KERNELS, Attention
from tessera.model.blocks import block_containers
from tessera.model.gated_deltanet import DeltaRuleMixer
from tessera.model.mamba import Mamba2Mixer, MambaMixer
from tessera.model.parallel_hybrid import ParallelHybrid
from tessera.model.masks import MaskSpec, allowed
from tessera.model.mla import LatentAttention
from tessera.model.moe import Experts


@dataclass(frozen=True)
class Lengths:
    """Positions one sample puts through the model: the main stream (decoder, or encoder-only) and an
    encoder-decoder's encoder."""

    tokens: int
    memory: int = 0


def sample_lengths(cfg: ModelConfig, seq_len: int) -> Lengths:
    """The lengths the recipe's objective builds from ``seq_len + 1`` tokens (span corruption: the
    encoder keeps the unmasked tokens and a sentinel per span, the decoder reads the spans)."""
    if resolved_objective(cfg) != "span_corruption":
        return Lengths(seq_len)
    length = seq_len + 1
    noise = min(max(round(length * cfg.mask_prob), 1), length - 1)
    spans = span_count(length, cfg.mask_prob, cfg.mean_span_length)
    return Lengths(tokens=noise + spans, memory=length - noise + spans)


@dataclass
class FlopCount:
    """Forward FLOPs of one sample by term, executed and model (see the module doc), and the forward
    FLOPs activation checkpointing recomputes."""

    executed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    model: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    recompute: float = 0.0
    # Backward / forward of a term: 2 (input and weight gradients) unless one operand needs no gradient.
    backward: dict[str, float] = field(default_factory=dict)

    def add(self, term: str, executed: float, model: float | None = None) -> None:
        """Add a forward term (``model`` defaults to ``executed``)."""
        self.executed[term] += executed
        self.model[term] += executed if model is None else model

    def _training(self, forward: dict[str, float]) -> float:
        return sum(value * (1.0 + self.backward.get(term, 2.0)) for term, value in forward.items())

    @property
    def model_training(self) -> float:
        """Model FLOPs of forward + backward (MFU's numerator per sample)."""
        return self._training(self.model)

    @property
    def hardware_training(self) -> float:
        """What the kernels execute for forward + backward, plus the checkpointed blocks' recompute."""
        return self._training(self.executed) + self.recompute


def _linear_term(name: str) -> str:
    first = name.split(".")[0]
    if first == "moe":
        return "moe_shared" if ".shared" in name else "moe_router"
    projections = {"attention": "attention_proj", "cross_attention": "attention_proj", "mamba": "mamba_proj"}
    return {**projections, "gdn": "delta_proj", "kda": "delta_proj"}.get(first, "ffn")


def _allowed_pairs(spec: MaskSpec, length: int, rows: int = 1024) -> float:
    """Pairs (query, key) ``spec``'s pattern allows over one sequence: closed forms for causal and full
    attention, else counted by blocks of query rows."""
    if not spec.windowed:
        return length * (length + 1) / 2 if spec.causal else float(length * length)
    if spec.pattern is None and spec.causal:  # a causal sliding window of w keys
        w = min(spec.window, length)
        return w * (w + 1) / 2 + (length - w) * w
    keys = torch.arange(length)[None]
    total = 0
    for start in range(0, length, rows):
        queries = torch.arange(start, min(length, start + rows))[:, None]
        total += int(allowed(spec, queries, keys).sum())
    return float(total)


def _pairs(spec: MaskSpec, ctx, length: int) -> tuple[float, float]:
    """(executed, model) (query, key) pairs of one head over a sequence under a stack's masking."""
    model = _allowed_pairs(spec, length)
    if ctx.blocks is None:
        return float(length * length), model
    layout = ctx.blocks
    n_blocks, keys = layout.mask.shape[1], layout.mask.shape[-1]
    return float(n_blocks * layout.block * keys + layout.n_global * length), model


def _attention(count: FlopCount, module: nn.Module, masking: tuple | None, q_len: int, k_len: int) -> None:
    """Score and value products of one attention layer (cross-attention: q_len decoder x k_len encoder)."""
    if isinstance(module, LatentAttention):
        qk, v, heads = module.nope + module.rope, module.v_dim, module.n_heads
    else:
        qk = v = module.head_dim
        heads = module.n_heads
    if isinstance(module, Attention) and module.kernel in LINEAR_KERNELS:
        features = module.features.n_features if module.features is not None else qk
        # Feature maps (performer: a projection of q and k), the numerator and the denominator. The
        # key-value summary is a contraction over keys when bidirectional; causal, it is an outer product
        # per key and a prefix sum (elementwise, not counted, as FlopCounterMode does not).
        if module.features is not None:  # the random projection is a fixed buffer: no weight gradient
            count.add("attention_features", heads * 2.0 * (q_len + k_len) * qk * features)
            count.backward["attention_features"] = 1.0
        products = 2.0 * q_len * features * v + 2.0 * q_len * features
        if masking is None or not masking[1].causal:
            products += 2.0 * k_len * features * v
        count.add("attention_scores", heads * products)
        return
    if masking is None:  # cross-attention: every decoder position reads every encoder position
        executed = model = float(q_len * k_len)
    else:
        executed, model = _pairs(*masking, q_len)
    per_pair = 2.0 * (qk + v) * heads
    count.add("attention_scores", per_pair * executed, per_pair * model)


def _mamba(count: FlopCount, mixer: nn.Module, length: int) -> float:
    """A Mamba layer's convolution and scan contractions; returns the convolution's executed FLOPs."""
    conv = mixer.conv1d
    conv_executed = 2.0 * conv.weight.numel() * length  # causal: padded on the left only, one output per position
    count.add("mamba_conv", conv_executed, conv_executed)
    if isinstance(mixer, MambaMixer):  # y_t = h_t . c_t over (inner, state)
        count.add("mamba_scan", 2.0 * length * mixer.inner * mixer.state)
    elif isinstance(mixer, Mamba2Mixer):  # SSD: per chunk a masked (L x L) product and the state passing
        heads, p, n = mixer.heads, mixer.head_dim, mixer.state
        executed = 0.0
        for start in range(0, length, mixer.chunk):
            chunk = min(mixer.chunk, length - start)
            executed += 2.0 * heads * chunk * chunk * (n + p) + 4.0 * heads * chunk * n * p
        # The first chunk reads the zero initial state, which needs no gradient; the last chunk's update of
        # the state (the final state, kept for decoding) gets none in training.
        first = 2.0 * heads * min(mixer.chunk, length) * n * p
        last = 2.0 * heads * (length - (length - 1) // mixer.chunk * mixer.chunk) * n * p
        count.add("mamba_scan", executed - first - last)
        count.add("mamba_scan_initial", first)
        count.add("mamba_scan_final", last)
        count.backward.update(mamba_scan_initial=1.0, mamba_scan_final=0.0)
    return conv_executed


def _delta_rule(count: FlopCount, mixer: DeltaRuleMixer, length: int) -> float:
    """A delta-rule layer (Gated DeltaNet, Kimi Delta Attention): its convolution and the products of the chunked
    form (:func:`~tessera.model.gated_deltanet.chunk_gated_delta_rule`), per chunk of L and state head: the k.k and
    q.k pair products (2 L^2 Dk each, per-channel decays included) and the state's four (2 L Dk Dv each: the
    correction w S, the read q S, the score-value product, the write). The first chunk reads the zero state (no
    gradient), the last chunk's write makes the final state (none in training). The triangular solves are no
    product torch counts, but their backward's gradient of the system is (2 L^2 (Dk + Dv)): returned, as it is
    backward-only work that a checkpointed block's recompute does not repeat."""
    count.add("delta_conv", 2.0 * mixer.conv_weight().numel() * length)
    chunk, heads, dk, dv = mixer.chunk, mixer.state_heads, mixer.key_head_dim, mixer.value_head_dim
    n = math.ceil(length / chunk)
    product = 2.0 * heads * chunk * dk * dv
    count.add("delta_pairs", 2 * 2.0 * heads * n * chunk * chunk * dk)
    count.add("delta_state", product * (4 * n - 3))
    count.add("delta_state_initial", 2 * product)
    count.add("delta_state_final", product)
    solve = 2.0 * heads * n * chunk * chunk * (dk + dv)
    count.add("delta_solve_backward", solve)
    count.backward.update(delta_state_initial=1.0, delta_state_final=0.0, delta_solve_backward=0.0)
    return solve


def _block(count: FlopCount, block: nn.Module, masking: tuple, lengths: tuple[int, int], top_k: int) -> float:
    """Add one block's forward terms; returns its executed forward FLOPs."""
    before = sum(count.executed.values())
    q_len, memory = lengths
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            memory_side = name.startswith("cross_attention.") and name.endswith(("k_proj", "v_proj"))
            count.add(_linear_term(name), 2.0 * module.weight.numel() * (memory if memory_side else q_len))
        elif isinstance(module, Experts):
            weights = (module.gate_proj, module.up_proj, module.down_proj)
            per_expert = sum(w[0].numel() for w in weights if w is not None)
            count.add("moe_experts", 2.0 * per_expert * top_k * q_len)
    if block.mamba is not None:
        _mamba(count, block.mamba, q_len)
    mixer = getattr(block, block.mixer_spec.attr)
    backward_only = _delta_rule(count, mixer, q_len) if isinstance(mixer, DeltaRuleMixer) else 0.0
    if block.attention is not None:
        _attention(count, block.attention, masking, q_len, q_len)
    if isinstance(mixer, ParallelHybrid):  # Falcon-H1's H layer: both halves on the same tokens
        _mamba(count, mixer.mamba, q_len)
        _attention(count, mixer.attention, masking, q_len, q_len)
    if block.cross_attention is not None:
        _attention(count, block.cross_attention, None, q_len, memory)
    return sum(count.executed.values()) - before - backward_only


def _stack_lengths(model: nn.Module, lengths: Lengths) -> list[tuple[nn.Module, int]]:
    if hasattr(model, "encoder"):
        return [(model.encoder, lengths.memory), (model.decoder, lengths.tokens)]
    return [(model, lengths.tokens)]


def _masking(stack: nn.Module, spec: MaskSpec, length: int) -> tuple[MaskSpec, object]:
    """The stack's mask spec and the attention context it builds for a whole sequence (on the CPU: a
    block-sparse plan's shape decides the executed pairs)."""
    return spec, stack._masking(spec, length, 0, None, torch.device("cpu"), 0)


def _not_recomputed(block: nn.Module, length: int) -> float:
    """The forward FLOPs of a checkpointed block that its recompute skips: torch's non-reentrant checkpoint
    stops once every tensor backward needs is back, so a pre-norm block's last product, whose output only
    feeds the residual add (the FFN's down projection, a Mamba layer's output projection), is not re-run."""
    if block.norm_position != "pre":  # post, sandwich, reordered: the last product feeds a norm, recomputed
        return 0.0
    if block.feed_forward is not None:
        last = block.feed_forward.down_proj
    elif block.moe is not None:  # the router statistics a training step records come after the shared expert
        last = None
    else:
        last = block.mamba.out_proj if block.mamba is not None else None
    return 2.0 * last.weight.numel() * length if last is not None else 0.0


def _recomputed(mode: str, every: int, index: int) -> bool:
    return mode == "full" or (mode == "selective" and index % every == 0)


def _repeat(cfg: ModelConfig) -> tuple[int, int] | None:
    """(first, period): layer ``i >= first`` is built like layer ``first + (i - first) % period`` (MoE every
    n-th after the dense ones, the layer pattern); None when layers may all differ (heads per layer)."""
    if cfg.attention.heads_per_layer:
        return None
    moe = cfg.moe
    first = moe.first_dense if moe.experts else 0
    return first, math.lcm(max(1, moe.every) if moe.experts else 1, max(1, len(cfg.layer_pattern)))


def _reduced(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with only as many layers as :func:`_repeat` needs (the same depth modulo the period, so the
    MTP blocks after the last layer are built alike)."""
    repeat = _repeat(cfg)
    if repeat is None:
        return cfg
    first, period = repeat

    def depth(n: int) -> int:
        return n if n <= first + 2 * period else first + period + (n - first) % period

    decoder = depth(cfg.n_decoder_layers) if cfg.n_decoder_layers else 0
    return dataclasses.replace(cfg, n_layers=depth(cfg.n_layers), n_decoder_layers=decoder)


def _depths(model: nn.Module, cfg: ModelConfig) -> list[int]:
    """The real depth of each stack of ``cfg``'s model, in :func:`_stack_lengths` order."""
    if hasattr(model, "encoder"):
        return [cfg.n_layers, cfg.n_decoder_layers or cfg.n_layers]
    return [cfg.n_layers]


def count_model(
    model: nn.Module, cfg: ModelConfig, lengths: Lengths, checkpoint: str = "none", every: int = 2
) -> FlopCount:
    """Forward FLOPs of one sample through ``cfg``'s model, from ``model`` (a zoo model, any device, meta
    included; it may hold fewer layers when they repeat, see :func:`_reduced`), with the recompute of
    ``checkpoint`` ("none", "full", "selective" every ``every``-th block, "op")."""
    count = FlopCount()
    top_k = cfg.moe.top_k if cfg.moe.experts else 0
    first, period = _repeat(cfg) or (0, 1)
    for (stack, length), depth in zip(_stack_lengths(model, lengths), _depths(model, cfg)):
        main = _masking(stack, stack.mask_spec, length)
        wide = _masking(stack, stack.global_mask_spec, length) if stack.global_mask_spec else main
        built = list(stack.layers.values())
        for index in range(depth):
            block = built[index] if index < len(built) else built[first + (index - first) % period]
            block = getattr(block, "_checkpoint_wrapped_module", block)
            conv_before = count.executed["mamba_conv"]
            executed = _block(count, block, wide if block.kind == "G" else main, (length, lengths.memory), top_k)
            if _recomputed(checkpoint, every, index):
                count.recompute += executed - _not_recomputed(block, length)
            elif checkpoint == "op":  # matmul and attention outputs are saved; the convolution is re-run
                count.recompute += count.executed["mamba_conv"] - conv_before
    _heads(count, model, cfg, lengths.tokens, top_k)
    return count


def _heads(count: FlopCount, model: nn.Module, cfg: ModelConfig, length: int, top_k: int) -> None:
    """The output head (once per prediction depth), an MLM head's transform, the MTP modules."""
    stack = model.decoder if hasattr(model, "decoder") else model
    in_blocks = {id(m) for layers in block_containers(model) for m in layers.modules()}
    mtp = getattr(model, "mtp", None) or {}
    in_mtp = {id(m) for module in mtp.values() for m in module.modules()}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in in_blocks and id(module) not in in_mtp:
            calls = 1 + len(mtp) if name.endswith("output") else 1
            count.add("head", 2.0 * module.weight.numel() * length * calls)
    masking = _masking(stack, stack.mask_spec, length) if mtp else None
    for module in mtp.values():
        count.add("mtp", 2.0 * module.eh_proj.weight.numel() * length)
        terms = FlopCount()
        _block(terms, module.block, masking, (length, 0), top_k)
        for term, value in terms.executed.items():
            count.add(f"mtp_{term}", value, terms.model[term])
        count.backward.update({f"mtp_{term}": ratio for term, ratio in terms.backward.items()})


_COUNTS: dict[tuple[str, int, str, int], FlopCount] = {}


def count_config(cfg: ModelConfig, seq_len: int, checkpoint: str = "none", every: int = 2) -> FlopCount:
    """:func:`count_model` of ``cfg`` built on the meta device, for ``seq_len`` training tokens per sample
    (kept per configuration: the planner asks for the same model under many layouts)."""
    key = (repr(cfg), seq_len, checkpoint, every)
    if key not in _COUNTS:
        with torch.device("meta"):
            model = build_model(_reduced(cfg))
        if len(_COUNTS) > 64:
            _COUNTS.clear()
        _COUNTS[key] = count_model(model, cfg, sample_lengths(cfg, seq_len), checkpoint, every)
    return _COUNTS[key]


def per_token(total: float, seq_len: int) -> float:
    """FLOPs of one sample as FLOPs per trained token."""
    return total / max(1, seq_len)


__all__ = ["FlopCount", "Lengths", "count_config", "count_model", "per_token", "sample_lengths"]
