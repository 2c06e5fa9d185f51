"""Llama 4's routing as a registered option: ``model.moe.scale_input``.

Llama 4 (HF ``Llama4TextMoe``) scores each token's top-1 (top-k) experts with the sigmoid of their router
logits and multiplies the expert's *input* by that score, ``expert(s * x)``, where other MoE layers weight
the output, ``s * expert(x)`` (different for a gated expert); an always-on shared expert is added unweighted
(``model.moe.shared_experts = 1``, no gate). With ``router = "sigmoid"`` and ``norm_topk = false`` the scores
are Llama 4's. Expert parallelism needs nothing more: the rows are scaled before they are dispatched.
"""

from __future__ import annotations

from typing import Any

from tessera import registry
from tessera.config.checks import require


def check_scale_input(m: Any) -> None:
    """The input-scaled routing of Llama 4 is a routing of MoE layers, with weights that are not renormalized."""
    moe = m.moe
    require(moe.experts > 1, "model.moe.scale_input is a routing option of MoE layers: set model.moe.experts > 1")
    require(
        not (moe.router == "sigmoid" and moe.norm_topk and moe.top_k == 1),
        "model.moe.scale_input with router='sigmoid', top_k=1 and norm_topk=true would scale every input by 1 "
        "(one weight renormalized); Llama 4 sets model.moe.norm_topk=false",
    )


SPEC = registry.register(
    registry.Spec(
        kind="option",
        name="moe_scale_input",
        feature="MoE routing weights on the expert input (Llama 4)",
        keys=("model.moe.scale_input",),
        uses=lambda m: m.moe.scale_input,
        unsupported={},
        checks=(check_scale_input,),
    )
)
