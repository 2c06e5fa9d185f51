"""The zoo's component catalog: importing it registers every spec the model declares (kernels,
mixers, FFN/MoE, position schemes, model options), each in the module of its code. compat, the
rules and the planner import this, then read :mod:`tessera.registry`.
"""

from __future__ import annotations

from tessera.model import ffn, kernels, mixers, moe, mtp, position, transformer  # noqa: F401  (registers them)
