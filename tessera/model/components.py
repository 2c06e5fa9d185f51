"""The zoo's component catalog: importing it registers every spec the model declares (kernels,
mixers, FFN/MoE, position schemes, model options), each in the module of its code. compat, the
rules and the planner import this, then read :mod:`tessera.registry`.
"""

from __future__ import annotations

from tessera.model import attention_chunks, attention_rules, ffn, gpt_oss_experts, kernels, mixers, moe, mtp  # noqa: F401
from tessera.model import layer_patterns, moe_routing, mup, position, sinks, softcap, transformer  # noqa: F401
