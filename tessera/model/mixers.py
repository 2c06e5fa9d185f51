"""The token mixers of the zoo and how a block finds its own: each registers a
:class:`tessera.registry.MixerSpec` in its module; the import line below is the registry line.

Adding a mixer: a new module ``tessera/model/<mixer>.py`` that registers its spec, and its name in
that line. (Kernels are listed in ``tessera/model/kernels/__init__.py``; the whole catalog, for
compat and the planner, in ``tessera/model/components.py``.)
"""

from __future__ import annotations

from tessera import registry
from tessera.config import ModelConfig
from tessera.model import attention, dsa, gated_deltanet, kimi_delta, mamba, mamba_alone, mla  # noqa: F401  (the registry line)
from tessera.model import parallel_hybrid  # noqa: F401  (the registry line, continued)


def layer_kind(cfg: ModelConfig, layer_id: int) -> str:
    """The ``model.layer_pattern`` letter of layer ``layer_id`` (A attention, G global attention, M Mamba, ...)."""
    pattern = cfg.layer_pattern or "A"
    return pattern[layer_id % len(pattern)]


def layer_letters() -> dict[str, str]:
    """Every ``model.layer_pattern`` letter a registered mixer serves -> what it means."""
    letters: dict[str, str] = {}
    for spec in registry.specs("mixer"):
        letters.update({k: v for k, v in spec.letters.items() if k not in letters})
    return letters


def mixer_for(cfg: ModelConfig, layer_id: int) -> registry.MixerSpec:
    """The mixer that builds layer ``layer_id``: the first registered one serving its letter that selects ``cfg``."""
    letter = layer_kind(cfg, layer_id)
    for spec in registry.specs("mixer"):
        if letter in spec.letters and spec.selects(cfg):
            return spec
    raise ValueError(f"no registered mixer builds model.layer_pattern letter {letter!r} of layer {layer_id}")
