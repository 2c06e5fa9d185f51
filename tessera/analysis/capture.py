"""Attention weights of a forward pass, recomputed exactly and handed to a callback, never kept on a module.

Inside :func:`observe_attention` every attention module calls ``observer(name, weights)`` with the
float32 weights (B, H, Tq, Tk) of each forward, whatever kernel trained the model: softmax kernels
(sdpa, sparse masks) run the eager kernel, which computes the same softmax with the same mask and
score bias but materializes the weights; linear kernels report their implicit weights
phi(q).phi(k) / sum; latent attention computes them beside its sdpa call. On exit the kernels and
observers are restored, so nothing stays on the model between steps.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tessera.model.attention import Attention, kernel_spec
from tessera.model.mla import LatentAttention

Observer = Callable[[str, torch.Tensor], None]
_LAYER = re.compile(r"(?:(encoder|decoder)\.)?layers\.(\d+)\.(attention|cross_attention)$")


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention module of ``model`` (self, cross and latent attention) by module name, in forward order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (Attention, LatentAttention))]


def layer_index(name: str) -> int:
    """The block index of an attention module name such as ``layers.3.attention``."""
    match = _LAYER.search(name)
    return int(match.group(2)) if match else -1


def _layer_parts(name: str) -> tuple[str, int, str] | None:
    """(stack, layer index, "cross" / "self" in a decoder or "") of an attention module's name, or None."""
    match = _LAYER.search(name)
    if not match:
        return None
    stack, index, kind = match.groups()
    role = ("cross" if kind == "cross_attention" else "self") if stack == "decoder" else ""
    return stack or "", int(index), role


def layer_label(name: str) -> str:
    """A readable label: "layer 3", "encoder layer 0", "decoder layer 1 (cross)"."""
    parts = _layer_parts(name)
    if parts is None:
        return name
    stack, index, role = parts
    return f"{stack + ' ' if stack else ''}layer {index}" + (f" ({role})" if role else "")


def layer_stem(name: str) -> str:
    """A file-name stem: "layer03", "encoder_layer00", "decoder_layer01_cross"."""
    parts = _layer_parts(name)
    if parts is None:
        return name.replace(".", "_")
    stack, index, role = parts
    return f"{stack + '_' if stack else ''}layer{index:02d}" + (f"_{role}" if role else "")


def is_cross(name: str) -> bool:
    """Whether the attention module ``name`` attends to the encoder output."""
    return name.endswith("cross_attention")


@contextlib.contextmanager
def observe_attention(
    model: nn.Module, observer: Observer, names: set[str] | None = None
) -> Iterator[list[tuple[str, nn.Module]]]:
    """Within the block, each attention module (those in ``names``, default all) calls ``observer(name, weights)``
    on every forward with its weights (B, H, Tq, Tk), computed exactly (see the module doc)."""
    layers = [(n, m) for n, m in attention_layers(model) if names is None or n in names]
    saved = [(m, getattr(m, "kernel", None)) for _, m in layers]
    try:
        for name, module in layers:
            if isinstance(module, Attention) and kernel_spec(module.kernel).scores:
                module.kernel = "eager"
            module.weights_observer = functools.partial(observer, name)
        yield layers
    finally:
        for module, kernel in saved:
            module.weights_observer = None
            if kernel is not None:
                module.kernel = kernel
