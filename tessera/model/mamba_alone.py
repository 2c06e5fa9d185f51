"""Mamba layers without a feed-forward sublayer, beside Mamba layers with one, in one model: the ``m`` letter of
``model.layer_pattern``.

``M`` layers follow ``[model.mamba].ffn`` for every Mamba layer of a model (Jamba: a FFN after each; Mamba: none).
Nemotron-H interleaves both: most Mamba-2 layers are followed by an MLP layer, some are not (``M-M-MM*-``...).
``m`` is the same mixer (the same module, parameter names, checks, compatibility and planner terms as the
``M`` layers of the model's Mamba version) with no FFN after it.
"""

from __future__ import annotations

import dataclasses

from tessera import registry
from tessera.model import mamba


def _alone(spec: registry.MixerSpec, version: int) -> registry.MixerSpec:
    return dataclasses.replace(
        spec,
        name=f"{spec.name}_alone",
        uses=lambda m: "m" in m.layer_pattern and (m.mamba.version == 2) == (version == 2),
        letters={"m": "Mamba without a feed-forward after it"},
        has_ffn=lambda cfg: False,
    )


MAMBA_ALONE = registry.register(_alone(mamba.MAMBA, 1))
MAMBA2_ALONE = registry.register(_alone(mamba.MAMBA2, 2))
