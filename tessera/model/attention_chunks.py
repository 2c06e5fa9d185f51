"""Chunked attention (Llama 4) as a registered option: ``model.attention.chunk_size``.

Llama 4's RoPE layers attend causally within fixed chunks of ``chunk_size`` positions (positions
``c * chunk_size .. (c + 1) * chunk_size - 1``) and never across a chunk boundary; its NoPE layers attend
globally. In tessera the chunked layers are the 'A' letters of ``model.layer_pattern``, the global ones
the 'G' letters (Llama 4 Scout: "AAAG" with ``position.nope_layers`` on every 'G'). The mask itself is one
rule of :func:`tessera.model.masks.allowed` (``MaskSpec.chunk``); whole sequences run the sliding windows'
block-sparse plan with a chunk-wide window (O(length x chunk)); decoding keeps full KV caches (a query at the
start of a chunk sees only itself, whatever came before).
"""

from __future__ import annotations

from typing import Any

from tessera import registry
from tessera.config.checks import require

# tp2 (+SP) and pp2 match one process (tests/integration/test_llama4_parallel.py): the mask is per position.
_LAYOUTS = {
    "cp": "context parallelism's ring attention has no chunk boundaries yet; run model.attention.chunk_size "
    "without parallel.cp",
}


def check_chunk_size(m: Any) -> None:
    """A positive chunk smaller than the context, in a decoder of plain softmax attention without a window."""
    a = m.attention
    if not a.chunk_size:
        return
    require(a.chunk_size > 0, f"model.attention.chunk_size must be positive (0 = off), got {a.chunk_size}")
    require(
        a.chunk_size < m.max_seq_len,
        f"model.attention.chunk_size={a.chunk_size} is not smaller than the context (model.max_seq_len="
        f"{m.max_seq_len}): one chunk would hold every key; set it below {m.max_seq_len}, or 0 for full attention",
    )
    kernel = registry.get("attention_kernel", a.kernel)
    require(
        m.arch == "decoder" and not a.sliding_window and kernel.scores and not kernel.pattern and not m.mla.kv_rank,
        "model.attention.chunk_size needs a decoder of standard softmax attention (sdpa, eager, chunked kernel) "
        "without model.attention.sliding_window or model.mla",
    )


SPEC = registry.option(
    name="chunked_attention",
    feature="chunked attention (Llama 4: causal within fixed chunks)",
    keys=("model.attention.chunk_size", "model.layer_pattern"),
    uses=lambda m: m.attention.chunk_size != 0,
    unsupported=_LAYOUTS,
    checks=(check_chunk_size,),
)
