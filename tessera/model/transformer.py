"""The three architectures: Decoder (causal LM), Encoder (masked LM, BERT) and EncoderDecoder (T5).

All are built from :class:`Stack` (positions, blocks, final norm), which also builds the
attention context (mask, score bias, RoPE tables) once per forward for all its layers.

Every part outside the blocks may be absent (set to None): a model without its token embedding
takes hidden states instead of token ids, one without its head returns hidden states. That is how
a pipeline stage is the same model with the other stages' parts removed.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.model.attention import Attention, AttnContext, SequenceSplit, SlidingKVCache, kernel_spec
from tessera.model.block import LayerCache, TransformerBlock
from tessera.model.ffn import ACTIVATIONS
from tessera.model.layer_patterns import layer_context, local_rotary, nope_layers
from tessera.model.mamba import Mamba2Mixer, MambaMixer
from tessera.model.masks import MaskSpec, attention_mask, block_layout, left_padded_positions, left_padding_mask
from tessera.model.moe import Experts, MoELog
from tessera.model.mtp import MTPLog, build_mtp, predict_ahead
from tessera.model.norm import build_norm
from tessera.model.softcap import output_head, token_embedding
from tessera.model.position import (
    AbsolutePositions,
    AlibiBias,
    RelativePositionBias,
    RotaryEmbedding,
    rope_scaling_of,
)

_RESIDUAL_OUT = ("o_proj", "down_proj")

# ``output_fn(h, output)``: what a caller computes from the final hidden states and the output head
# instead of the logits ``output(h)``; a training loss passes one that fuses the head into the
# loss, so the (tokens x vocab) logits never exist whole (tessera.train.loss.FusedHeadLoss).
OutputFn = Callable[[torch.Tensor, nn.Linear], torch.Tensor]


def apply_output(h: torch.Tensor, output: nn.Linear | None, output_fn: OutputFn | None) -> torch.Tensor:
    """``output_fn(h, output)``, or the logits ``output(h)``; ``h`` itself when the head is absent."""
    if output is None:
        return h
    return output(h) if output_fn is None else output_fn(h, output)


class Stack(nn.Module):
    """Absolute positions (if any), ``n_layers`` blocks and, for pre-norm, the final norm."""

    def __init__(self, cfg: ModelConfig, n_layers: int, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.cfg, self.causal = cfg, causal
        head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.pos_embeddings = (
            AbsolutePositions(cfg.position.kind, cfg.max_seq_len, cfg.dim)
            if cfg.position.kind in ("learned", "sinusoidal")
            else None
        )
        self.embed_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if cfg.embed_norm else None
        self.embed_dropout: nn.Module | None = nn.Dropout(cfg.dropout)
        self.rope = None
        if cfg.position.kind == "rope":
            self.rope = RotaryEmbedding(
                cfg.mla.rope_head_dim if cfg.mla.kv_rank else head_dim,
                cfg.max_seq_len,
                cfg.position.rope_theta,
                rope_scaling_of(cfg.position, cfg.max_seq_len),
                cfg.position.rotary_fraction,
            )
        # Per-layer patterns (tessera.model.layer_patterns): the local layers' own RoPE, the NoPE layers.
        self.local_rope = local_rotary(cfg, cfg.mla.rope_head_dim if cfg.mla.kv_rank else head_dim)
        self.nope_layers = nope_layers(cfg)
        # A score bias (T5 relative buckets or ALiBi): (B|1, H, Tq, Tk) added to every layer's scores.
        self.rel_bias: nn.Module | None = None
        if cfg.position.kind == "t5_bias":
            pos = cfg.position
            self.rel_bias = RelativePositionBias(cfg.n_heads, pos.rel_buckets, pos.rel_max_distance, not causal)
        elif cfg.position.kind == "alibi":
            self.rel_bias = AlibiBias(cfg.n_heads)
        # A ModuleDict keyed by layer index keeps parameter names stable when stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, cross) for i in range(n_layers)})
        self.norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if cfg.norm_position != "post" else None
        self.mask_spec = MaskSpec(
            cfg.attention.kernel,
            causal,
            cfg.attention.sliding_window,
            cfg.attention.global_tokens,
            cfg.attention.block_size,
            cfg.attention.random_blocks,
            cfg.max_seq_len,
            cfg.attention.chunk_size,
        )
        # 'G' layers of model.layer_pattern: the same attention without the sliding window or chunks.
        global_spec = dataclasses.replace(self.mask_spec, window=0, chunk=0)
        self.global_mask_spec = global_spec if "G" in cfg.layer_pattern else None
        # Set from outside when each forward holds only part of every sequence (context parallelism).
        self.sequence_split: SequenceSplit | None = None

    def context(
        self,
        batch: int,
        length: int,
        start: int,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        device: torch.device,
        kv_start: int = 0,
    ) -> AttnContext:
        """Mask, bias and RoPE tables for ``length`` queries at ``start`` (shared by all layers); keys
        are positions ``kv_start .. start + length - 1`` (a sliding-window cache keeps only the last ones)."""
        if positions is not None and tuple(positions.shape) not in ((batch, length), (1, length)):
            raise ValueError(f"positions must have shape {(batch, length)}, got {tuple(positions.shape)}")
        ctx = self._masking(self.mask_spec, length, start, document_ids, device, kv_start)
        if self.rope is not None:
            ctx.cos, ctx.sin = self.rope(start, length, positions)
        if self.rel_bias is not None and self.sequence_split is not None:
            # Global indices: within a document they differ as its own positions do (others are masked).
            split = self.sequence_split
            ctx.bias = self.rel_bias(split.positions(length, device), split.key_positions(length, device))
        elif self.rel_bias is not None:
            kv_len = start + length
            q_pos = positions if positions is not None else torch.arange(start, kv_len, device=device)[None]
            k_pos = positions if positions is not None else torch.arange(kv_start, kv_len, device=device)[None]
            ctx.bias = self.rel_bias(q_pos, k_pos)
        return ctx

    def _needs_dense_mask(self) -> bool:
        """Whether any attention layer of this stack runs a kernel that reads the whole mask now (configured,
        or set by an inspection tool for this forward: ``KernelSpec.dense_mask``)."""
        kernels = {getattr(getattr(layer, "attention", None), "kernel", None) for layer in self.layers.values()}
        return any(kernel_spec(k).dense_mask for k in ({self.cfg.attention.kernel} | kernels) - {None})

    def _masking(
        self,
        spec: MaskSpec,
        length: int,
        start: int,
        document_ids: torch.Tensor | None,
        device: torch.device,
        kv_start: int,
    ) -> AttnContext:
        """Which keys each query sees: a mask, a block-sparse plan, or a split sequence's own attention."""
        kernel = self.cfg.attention.kernel
        if not kernel_spec(kernel).scores:
            if document_ids is not None:
                raise ValueError(
                    f"model.attention='{kernel}' cannot block attention across documents; use sdpa or eager"
                )
            return AttnContext(causal=self.causal)
        if self.sequence_split is not None:
            return AttnContext(
                causal=self.causal, attend=self.sequence_split.attention(spec, length, document_ids, device)
            )
        kv_len = start + length - kv_start
        # The block-sparse kernel serves plain attention without a dense score bias (eager keeps dense
        # weights for inspection tools, which switch layers to eager; latent attention reads the mask itself).
        sparse_ok = not self._needs_dense_mask() and self.rel_bias is None and not self.cfg.mla.kv_rank
        if sparse_ok and start == 0 and kv_start == 0:
            blocks = block_layout(spec, length, device, document_ids)
            if blocks is not None:
                return AttnContext(blocks=blocks, causal=self.causal)
        mask = attention_mask(spec, length, kv_len, device, document_ids, kv_start)
        return AttnContext(mask=mask, is_causal=self.causal and mask is None and length == kv_len, causal=self.causal)

    def global_context(
        self, ctx: AttnContext, length: int, start: int, document_ids: torch.Tensor | None, device: torch.device
    ) -> AttnContext:
        """``ctx`` with the masking of the 'G' layers of ``model.layer_pattern`` (no sliding window;
        they keep full caches, so their keys start at 0)."""
        g = self._masking(self.global_mask_spec, length, start, document_ids, device, 0)
        return dataclasses.replace(ctx, mask=g.mask, blocks=g.blocks, is_causal=g.is_causal, attend=g.attend)

    def embed_positions(self, h: torch.Tensor, start: int, positions: torch.Tensor | None) -> torch.Tensor:
        """Absolute positions, embedding norm and dropout on freshly embedded tokens (first stage only)."""
        if self.pos_embeddings is not None:
            pos = positions if positions is not None else torch.arange(start, start + h.shape[1], device=h.device)
            h = h + self.pos_embeddings(pos).to(h.dtype)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return self.embed_dropout(h) if self.embed_dropout is not None else h

    def hidden_states(
        self,
        h: torch.Tensor,
        caches: list[LayerCache] | None = None,
        start: int = 0,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        moe_log: MoELog | None = None,
        left_pad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embedded tokens (B, T, dim) through positions, every block and the final norm.

        ``moe_log`` (a :data:`tessera.model.moe.MoELog`) collects the MoE layers' routing stats;
        ``left_pad`` (B,) counts each row's padding positions at the start (see :meth:`padded`).
        """
        b, t, _ = h.shape
        if memory is not None and self.sequence_split is not None:  # cross-attention reads every encoder position
            memory = self.sequence_split.whole_sequence(memory)
        if left_pad is not None:
            positions = self._check_padding(left_pad, start, t, positions, caches)
        if positions is None and self.sequence_split is not None:
            positions = self.sequence_split.positions(t, h.device)
        h = self.embed_positions(h, start, positions)
        kv_start = next((c.key_start(start) for c in caches or () if isinstance(c, SlidingKVCache)), 0)
        # Score biases are relative: padding shifts queries and keys alike, so they keep the slot positions.
        ctx_positions = positions if left_pad is None or self.rel_bias is None else None
        ctx = self.context(b, t, start, ctx_positions, document_ids, h.device, kv_start)
        ctx.moe_log, ctx.document_ids, ctx.split = moe_log, document_ids, self.sequence_split
        global_ctx = (
            self.global_context(ctx, t, start, document_ids, h.device) if self.global_mask_spec is not None else ctx
        )
        if left_pad is not None:
            ctx, global_ctx = self.padded(ctx, left_pad, t, start), self.padded(global_ctx, left_pad, t, start)
        local = self.local_rope(start, t, ctx_positions) if self.local_rope is not None else None
        contexts, shared = {"A": ctx, "G": global_ctx}, {}
        for i, (name, layer) in enumerate(self.layers.items()):
            layer_ctx = layer_context(int(name), layer.kind, contexts, local, self.nope_layers, shared)
            h = layer(h, layer_ctx, caches[i] if caches is not None else None, start, memory)
        if self.norm is None:  # post-norm, or a pipeline stage before the last
            return h
        h = self.norm(h)
        return h * self.cfg.mup.head if self.cfg.mup.head != 1.0 else h  # muP's logit factor (see model/mup.py)

    def _check_padding(
        self,
        left_pad: torch.Tensor,
        start: int,
        length: int,
        positions: torch.Tensor | None,
        caches: list[LayerCache] | None,
    ) -> torch.Tensor:
        """The positions of a left-padded batch (counted from each row's first real token)."""
        if self.mask_spec.chunk:
            raise ValueError(
                "left padding with chunked attention (model.attention.chunk_size) is not supported: chunks would "
                "start at the padding; generate rows of different lengths one at a time"
            )
        if any(isinstance(c, SlidingKVCache) for c in caches or ()):
            raise ValueError(
                "left padding with a sliding-window ring-buffer cache is not supported; generate rows of "
                "different lengths one at a time"
            )
        if not kernel_spec(self.cfg.attention.kernel).scores or registry.recurrent_layers(self.layers.values()):
            raise ValueError(
                "left padding needs softmax attention in every layer (linear kernels and Mamba layers would carry "
                "the padding in their state); generate rows of different lengths one at a time"
            )
        return left_padded_positions(left_pad, start, length) if positions is None else positions

    def padded(self, ctx: AttnContext, left_pad: torch.Tensor, length: int, start: int) -> AttnContext:
        """``ctx`` with each row's first ``left_pad[b]`` cache positions hidden from every query."""
        mask = left_padding_mask(ctx.mask, ctx.is_causal, left_pad, length, start + length)
        return dataclasses.replace(ctx, mask=mask, is_causal=False)

    def new_caches(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> list[LayerCache]:
        """One empty decoding cache per layer (KV, latent K/V or Mamba state), sized for ``max_len`` positions;
        plain sliding-window attention layers keep only the window, in a ring buffer (Longformer/BigBird's
        global and random keys, and 'G' layers, need them all)."""
        spec = self.mask_spec
        ring = spec.window and spec.causal and not kernel_spec(spec.kernel).pattern and spec.window < max_len

        def cache(layer: TransformerBlock) -> LayerCache:
            if ring and layer.kind == "A" and type(layer.attention) is Attention:
                attn = layer.attention
                return SlidingKVCache(batch, attn.n_kv_heads, attn.head_dim, spec.window, dtype, device)
            return layer.new_cache(batch, max_len, dtype, device)

        return [cache(layer) for layer in self.layers.values()]


ModuleSeed = Callable[[str, nn.Module], int]  # (module name, module) -> seed of its random draws


def module_seed(base: int) -> ModuleSeed:
    """Seeds that depend only on the base seed and a module's name: a module's initial weights are
    then the same whatever else the model holds (a pipeline stage, a pruned model) or how it was
    built."""
    return lambda name, _module: zlib.crc32(f"{base}/{name}".encode())


def init_weights(model: nn.Module, cfg: ModelConfig, seed_of: ModuleSeed | None = None) -> None:
    """Normal(0, init_std) weights; residual-output projections scaled by 1/sqrt(2 n_layers).

    Each module draws from the global RNG reseeded by ``seed_of(name, module)`` (default: from the
    last ``torch.manual_seed`` and the module's name), so weights do not depend on module order;
    the caller's RNG state is left as it was. A sharding layer passes seeds that also name the
    shard, so the shards of one tensor are not copies of each other.
    """
    seed_of = seed_of or module_seed(torch.initial_seed())
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        for name, module in model.named_modules():
            torch.manual_seed(seed_of(name, module))
            _init_module(name, module, cfg)
        for name, module in model.named_modules():  # after their linears: the SSM's A, D and time step
            if isinstance(module, (MambaMixer, Mamba2Mixer)):
                torch.manual_seed(seed_of(name, module) + 1)
                module.reset_parameters()


def _init_module(name: str, module: nn.Module, cfg: ModelConfig) -> None:
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=out_std if name.endswith(_RESIDUAL_OUT) else std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, Experts):
        for pname, p in module.named_parameters(recurse=False):
            nn.init.normal_(p, mean=0.0, std=out_std if pname == "down_proj" else std)
    elif isinstance(module, AbsolutePositions):
        module.reset_parameters(std)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


class TiedOutput:
    """What the three architectures share at the top: the output head tied to the token embedding
    (``model.tie_embeddings``) and :meth:`init_weights`."""

    cfg: ModelConfig
    tok_embeddings: nn.Embedding
    output: nn.Linear

    def init_weights(self, seed_of: ModuleSeed | None = None) -> None:
        """See :func:`init_weights`."""
        init_weights(self, self.cfg, seed_of)

    def _tie_and_init(self) -> None:
        """Share the token embedding's weight with the output head when the config ties them, then initialize."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()


class Decoder(TiedOutput, Stack):
    """Causal LM: token embedding, ``n_layers`` causal blocks, final norm, output head (optionally tied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, cfg.n_layers, causal=True)
        self.tok_embeddings = token_embedding(cfg)  # scaled by sqrt(dim) under model.embed_scale (Gemma)
        self.output = output_head(cfg)  # soft-capped logits under model.logit_softcap (Gemma 2)
        self.mtp = build_mtp(cfg)  # multi-token prediction modules (model.mtp_depth), or None
        self._tie_and_init()

    def forward(
        self,
        tokens: torch.Tensor,
        caches: list[LayerCache] | None = None,
        start: int = 0,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        moe_log: MoELog | None = None,
        left_pad: torch.Tensor | None = None,
        mtp: MTPLog | None = None,
        output_fn: OutputFn | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab). With ``caches``, queries start at position ``start``; ``positions``
        (B, T) overrides position ids; ``document_ids`` (B, T) blocks attention across documents;
        ``moe_log`` collects MoE routing stats; ``left_pad`` (B,) says how many positions at the start
        of each row are padding (batched prompts of different lengths); ``mtp`` collects the
        multi-token-prediction modules' logits (training; they do not run without it);
        ``output_fn(h, self.output)`` replaces ``self.output(h)`` (see :data:`OutputFn`). Without an
        embedding ``tokens`` are hidden states, without a head the result is (pipeline stages)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        h = self.hidden_states(h, caches, start, positions, document_ids, moe_log=moe_log, left_pad=left_pad)
        if self.output is not None and mtp is not None and self.mtp is not None:
            predict_ahead(self, tokens, h, mtp, positions, document_ids, moe_log)
        return apply_output(h, self.output, output_fn)

    def new_caches(
        self, batch: int, max_len: int, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> list[LayerCache]:
        """One empty KV cache per layer, sized for ``max_len`` positions (default: the head's dtype and device;
        :func:`tessera.model.cache.new_caches` builds int8 ones)."""
        weight = self.output.weight
        return super().new_caches(batch, max_len, dtype or weight.dtype, device or weight.device)


class MLMHead(nn.Module):
    """BERT's prediction-head transform: dense, activation, norm (the vocab projection follows)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.act = ACTIVATIONS[cfg.activation]  # a gated FFN's activation without the gate
        self.norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Transformed hidden states."""
        return self.norm(self.act(self.dense(h)))


class Encoder(TiedOutput, Stack):
    """Bidirectional encoder with a masked-LM head (BERT); tied output with a vocab bias."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, cfg.n_layers, causal=False)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.dim) if cfg.type_vocab_size else None
        self.head = MLMHead(cfg)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=True)
        self._tie_and_init()

    def embed(self, tokens: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ token-type) embeddings (B, T, dim)."""
        h = self.tok_embeddings(tokens)
        if self.type_embeddings is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(tokens)
            h = h + self.type_embeddings(types)
        return h

    def encode(
        self,
        tokens: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        moe_log: MoELog | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, dim); ``tokens`` are hidden states when the embedding is absent."""
        h = self.embed(tokens, token_type_ids) if self.tok_embeddings is not None else tokens
        return self.hidden_states(h, positions=positions, document_ids=document_ids, moe_log=moe_log)

    def forward(
        self,
        tokens: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        moe_log: MoELog | None = None,
        output_fn: OutputFn | None = None,
    ) -> torch.Tensor:
        """Masked-LM logits (B, T, vocab) (hidden states when the head is absent: pipeline stages);
        ``output_fn`` as in :meth:`Decoder.forward`."""
        h = self.encode(tokens, token_type_ids, positions, document_ids, moe_log)
        return apply_output(self.head(h), self.output, output_fn) if self.output is not None else h


class EncoderDecoder(TiedOutput, nn.Module):
    """Seq2seq (T5): shared token embedding, encoder stack, decoder stack with cross-attention, head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.encoder = Stack(cfg, cfg.n_layers, causal=False)
        self.decoder = Stack(cfg, cfg.n_decoder_layers or cfg.n_layers, causal=True, cross=True)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._tie_and_init()

    def encode(self, input_ids: torch.Tensor, moe_log: MoELog | None = None) -> torch.Tensor:
        """Encoder output (B, S, dim), the decoder's cross-attention memory."""
        return self.encoder.hidden_states(self.tok_embeddings(input_ids), moe_log=moe_log)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        caches: list[LayerCache] | None = None,
        start: int = 0,
        moe_log: MoELog | None = None,
        output_fn: OutputFn | None = None,
    ) -> torch.Tensor:
        """Decoder logits (B, T, vocab) given the encoder ``memory``; ``output_fn`` as in :meth:`Decoder.forward`."""
        h = self.decoder.hidden_states(
            self.tok_embeddings(decoder_input_ids), caches, start, memory=memory, moe_log=moe_log
        )
        if self.cfg.output_dim_scale:
            h = h * self.cfg.dim**-0.5
        return apply_output(h, self.output, output_fn)

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        *,
        moe_log: MoELog | None = None,
        output_fn: OutputFn | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, vocab) of ``decoder_input_ids`` conditioned on ``input_ids``.

        Parts may be absent (a pipeline stage); floating inputs are then hidden states, integer
        ones token ids. With encoder blocks, ``input_ids`` (token ids or the encoder's hidden
        states) runs through them (and the encoder's final norm where present, making it the
        memory); without, ``input_ids`` is the memory. Without decoder blocks the result is
        ``(encoder hidden states or memory, decoder_input_ids)``; with them,
        ``decoder_input_ids`` (token ids or the decoder's hidden states) runs through them,
        cross-attending to the memory, and the result is ``(memory, hidden states)``, or the
        logits where the head is present (``output_fn`` as in :meth:`Decoder.forward`).
        """
        source, target = input_ids, decoder_input_ids
        if self.encoder is not None:
            h = source if source.is_floating_point() else self.tok_embeddings(source)
            source = self.encoder.hidden_states(h, moe_log=moe_log)
        if self.decoder is None:
            return source, target
        h = target if target.is_floating_point() else self.tok_embeddings(target)
        h = self.decoder.hidden_states(h, memory=source, moe_log=moe_log)
        if self.output is None:
            return source, h
        if self.cfg.output_dim_scale:
            h = h * self.cfg.dim**-0.5
        return apply_output(h, self.output, output_fn)

    def new_caches(
        self, batch: int, max_len: int, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> list[LayerCache]:
        """Decoder self-attention caches."""
        weight = self.output.weight
        return self.decoder.new_caches(batch, max_len, dtype or weight.dtype, device or weight.device)


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Unique parameters (tied weights once); optionally without the token embedding table."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and "tok_embeddings" in name:
            continue
        total += p.numel()
    return total


def _option(name: str, feature: str, key: str, uses: Callable[[ModelConfig], bool], unsupported: dict) -> None:
    registry.option(name=name, feature=feature, keys=(key,), uses=uses, unsupported=unsupported, checks=())


_option("tied_embeddings", "tied embeddings", "model.tie_embeddings", lambda m: m.tie_embeddings, {})
_option("encoder", "encoder (masked LM)", "model.arch", lambda m: m.arch == "encoder", {})
_option("encoder_decoder", "encoder-decoder", "model.arch", lambda m: m.arch == "encoder_decoder", {})
