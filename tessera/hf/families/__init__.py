"""Per-family mappings between HF transformers checkpoints and tessera: configs and weight names.

One module per family group; each has ``from_hf`` (HF config.json dict -> ModelConfig keyword
args, raising :class:`HFConversionError` for any option tessera cannot reproduce), ``to_hf``
(ModelConfig -> HF config dict) and ``rules`` (ModelConfig -> weight-name rules, see
:class:`Rule`), registered in :data:`FAMILIES` under HF's ``model_type``.
"""

from __future__ import annotations

from tessera.hf.families import bert, deepseek, deepseek_v32, gpt2, kimi_linear, llama, mamba, moe, qwen3_next, t5
from tessera.hf.families import gemma3, gpt_oss, olmo3, smollm3
from tessera.hf.families import falcon_h1, llama4, nemotron_h, qwen3_5
from tessera.hf.families.common import Family, HFConversionError, Rule

FAMILIES: dict[str, Family] = {
    **llama.FAMILIES,
    **gpt2.FAMILIES,
    **bert.FAMILIES,
    **t5.FAMILIES,
    **moe.FAMILIES,
    **mamba.FAMILIES,
    **deepseek.FAMILIES,
    **deepseek_v32.FAMILIES,
    **qwen3_next.FAMILIES,
    **kimi_linear.FAMILIES,
    **gemma3.FAMILIES,
    **olmo3.FAMILIES,
    **smollm3.FAMILIES,
    **gpt_oss.FAMILIES,
    **qwen3_5.FAMILIES,
    **nemotron_h.FAMILIES,
    **falcon_h1.FAMILIES,
    **llama4.FAMILIES,
}

__all__ = ["FAMILIES", "Family", "HFConversionError", "Rule"]
