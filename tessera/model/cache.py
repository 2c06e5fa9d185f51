"""Decoding caches by kind: full precision (the model's dtype, fp32, bf16, fp16) or int8.

A layer's cache (:class:`~tessera.model.attention.KVCache`, the latent cache of latent attention,
a sliding-window ring buffer) keeps its keys and values in tensors it indexes along the positions
(``self.k[:, :, start:end] = k`` to write, ``self.k[:, :, :end]`` to read). The int8 kind swaps
those tensors for :class:`Int8Rows`, which quantizes each written row (one token of one head)
with its own scale and dequantizes what is read, inside the attention call: the same cache
classes, the same interface, a quarter of the float32 bytes (plus one fp16 scale per row).
Recurrent states (Mamba) are never quantized: they are rewritten every step.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.dtypes import DTYPES

CACHE_DTYPES = DTYPES  # the cache kinds that are plain dtypes
CACHE_KINDS = ("auto", *CACHE_DTYPES, "int8")  # auto: the model's parameter dtype

_SCALE_DTYPE = torch.float16
_SCALE_MIN = 2.0**-24  # float16's smallest subnormal: an all-zero row keeps a finite scale
_SCALE_MAX = 65504.0  # float16's largest finite value


class Int8Rows:
    """A (..., D) tensor kept as int8 with one float16 scale per row (per index of all dims but the last).

    Writing ``rows[index] = x`` quantizes each row of ``x`` symmetrically (scale = max|row| / 127);
    reading ``rows[index]`` returns ``int8 * scale`` in ``dtype``. ``index`` may select along any
    dimension but the last (slices or integer tensors), as the caches do.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype
        self.data = torch.zeros(shape, dtype=torch.int8, device=device)
        self.scale = torch.ones(*shape[:-1], 1, dtype=_SCALE_DTYPE, device=device)

    def __setitem__(self, index: Any, value: torch.Tensor) -> None:
        value = value.detach().float()
        # Round the scale to its stored dtype first, so that reads divide by exactly what was used.
        scale = (value.abs().amax(dim=-1, keepdim=True) / 127).clamp(_SCALE_MIN, _SCALE_MAX).to(_SCALE_DTYPE)
        self.data[index] = (value / scale.float()).round().clamp(-127, 127).to(torch.int8)
        self.scale[index] = scale

    def __getitem__(self, index: Any) -> torch.Tensor:
        return (self.data[index].float() * self.scale[index].float()).to(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held: the int8 values and their scales."""
        return self.data.nbytes + self.scale.nbytes


def tensor_bytes(value: Any) -> int:
    """Bytes of a cache attribute: a tensor, :class:`Int8Rows`, or 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return value.nbytes if isinstance(value, Int8Rows) else 0


def cache_bytes(caches: list) -> int:
    """Memory held by decoding caches (every tensor they keep)."""
    return sum(tensor_bytes(t) for c in caches for t in vars(c).values())


def _is_recurrent(cache: Any) -> bool:
    """A state rewritten in place every step (Mamba's): it has no positions to write rows into."""
    return not hasattr(cache, "update")


def _materialize(cache: Any, device: torch.device, int8: bool) -> Any:
    """Replace a cache's meta tensors by zeros on ``device`` (positional float ones by Int8Rows when ``int8``)."""
    for name, value in vars(cache).items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            quantize = int8 and value.is_floating_point() and not _is_recurrent(cache)
            new = Int8Rows(value.shape, value.dtype, device) if quantize else torch.zeros_like(value, device=device)
            setattr(cache, name, new)
    return cache


def new_caches(model: torch.nn.Module, batch: int, max_len: int, kind: str = "auto") -> list:
    """One empty decoding cache per layer of ``model`` for ``batch`` rows of ``max_len`` positions, keys and values
    stored as ``kind`` (see :data:`CACHE_KINDS`; int8 dequantizes to the model's dtype)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown KV-cache kind {kind!r}; choose one of {', '.join(CACHE_KINDS)}")
    weight = model.output.weight
    dtype = CACHE_DTYPES.get(kind, weight.dtype)
    caches = model.new_caches(batch, max_len, dtype, torch.device("meta"))
    return [_materialize(c, weight.device, kind == "int8") for c in caches]


def cache_footprint(model: torch.nn.Module, kind: str = "auto") -> tuple[int, int]:
    """(bytes per token of context, fixed bytes) of one sequence's decoding caches: KV caches grow with the
    context (latent attention's far less, int8 ones a quarter of float32's), Mamba states do not."""
    one, two = cache_bytes(new_caches(model, 1, 1, kind)), cache_bytes(new_caches(model, 1, 2, kind))
    return two - one, 2 * one - two


def layer_caches(blocks: list[torch.nn.Module], batch: int, max_len: int, kind: str, like: torch.Tensor) -> list:
    """Caches of ``kind`` for standalone ``blocks`` (e.g. multi-token-prediction modules), on ``like``'s device."""
    dtype = CACHE_DTYPES.get(kind, like.dtype)
    caches = [block.new_cache(batch, max_len, dtype, torch.device("meta")) for block in blocks]
    return [_materialize(c, like.device, kind == "int8") for c in caches]
