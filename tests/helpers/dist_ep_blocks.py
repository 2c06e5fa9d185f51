"""Under torchrun (4 ranks): an expert-parallel MoE block's outputs and every gradient equal the single-device block's.

Layouts: ep=4; ep=2 in two data-parallel groups; ep=2 made of two tp ranks (which hold the same
tokens and split the rows between them); ep=4 made of 2 data ranks x 2 tp ranks. For each, MoE
variants: top-2 dropless, switch with capacity dropping, shared experts with a sigmoid gate,
DeepSeek-V3 routing (sigmoid scores, group-limited top-k, a non-zero aux-free bias, per-sequence
aux loss), and one in bf16 (grouped matmul) against the bf16 single-device block.

Every data rank d feeds its own tokens x_d; the reference runs the unsharded block on each x_d in
one process and sums the losses (so capacity and aux losses see the same per-rank tokens).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from distexit import run_and_exit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tessera.config import model_config
from tessera.model import MoELog, moe_loss
from tessera.model.attention import AttnContext
from tessera.model.block import TransformerBlock
from tessera.parallel.expert import ExpertParallelExperts, apply_expert_parallel

VARIANTS = {
    "top2": {},
    "switch_capacity": {"moe_top_k": 1, "moe_capacity_factor": 1.0, "moe_router": "softmax_topk"},
    "shared_gate": {"moe_shared_experts": 1, "moe_shared_gate": True, "moe_z_loss_coef": 0.01},
    "deepseek_v3": {
        "moe_router": "sigmoid",
        "moe_groups": 4,
        "moe_topk_groups": 2,
        "moe_top_k": 3,
        "moe_bias_update_rate": 0.01,
        "moe_route_scale": 2.5,
        "moe_aux_loss_scope": "sequence",
    },
}
B, T, DIM = 2, 8, 32


def _block(dtype: torch.dtype, **moe) -> TransformerBlock:
    cfg = model_config(
        vocab_size=300, dim=DIM, n_heads=4, moe_experts=8, moe_ffn_hidden=24, moe_aux_loss_coef=0.1, **moe
    )
    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if block.moe.expert_bias is not None:
        block.moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    return block.to(dtype)


def _loss(block: torch.nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    log = MoELog()
    y = block(x, AttnContext(is_causal=True, moe_log=log))
    return (y.float() * cotangent).sum() + moe_loss(log)


def check(name: str, dtype: torch.dtype, ep_mesh, tp_mesh, replicas, data_rank: int, n_data: int) -> None:
    """``replicas``: the group of ranks holding the same experts (None: one ep group)."""
    moe = VARIANTS.get(name, {})
    ref = _block(dtype, **moe)
    xs = [torch.randn(B, T, DIM, generator=torch.Generator().manual_seed(10 + d)).to(dtype) for d in range(n_data)]
    cots = [torch.randn(B, T, DIM, generator=torch.Generator().manual_seed(20 + d)) for d in range(n_data)]
    x_ref = [x.clone().requires_grad_() for x in xs]
    ref_outs = []
    for x, c in zip(x_ref, cots):
        _loss(ref, x, c).backward()
        ref_outs.append(ref(x, AttnContext(is_causal=True)).detach())
    ep = copy.deepcopy(_block(dtype, **moe))
    apply_expert_parallel(ep, ep_mesh, tp_mesh)
    assert isinstance(ep.moe.experts, ExpertParallelExperts)
    x = xs[data_rank].clone().requires_grad_()
    _loss(ep, x, cots[data_rank]).backward()
    out = ep(x, AttnContext(is_causal=True)).detach()
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    where = f"{name} {dtype} ep={ep_mesh.size()} tp={tp_mesh.size() if tp_mesh else 1}"
    torch.testing.assert_close(out, ref_outs[data_rank], **tol, msg=lambda m: f"{where} output: {m}")
    torch.testing.assert_close(x.grad, x_ref[data_rank].grad, **tol, msg=lambda m: f"{where} input grad: {m}")
    tp = tp_mesh.size() if tp_mesh else 1
    ref_params = dict(ref.named_parameters())
    for pname, p in ep.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):  # an expert: sums the tokens of its ep group; add the other groups'
            grad = grad.full_tensor()
            if replicas is not None:
                dist.all_reduce(grad, group=replicas)
        else:  # replicated: each data rank's share (tp ranks hold the same one)
            grad = grad.clone()
            dist.all_reduce(grad)
            grad /= tp
        torch.testing.assert_close(grad, ref_params[pname].grad, **tol, msg=lambda m: f"{where} grad {pname}: {m}")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        flat = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        tp_pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_tp = tp_pairs[("dp", "tp")]._flatten("dp_tp")
        layouts = [  # ep mesh, tp mesh, replicas group, data rank, data ranks
            (flat, None, None, rank, 4),
            (pairs["ep"], None, pairs["dp"].get_group(), rank, 4),
            (tp_pairs["tp"], tp_pairs["tp"], tp_pairs["dp"].get_group(), rank // 2, 2),
            (dp_tp, tp_pairs["tp"], None, rank // 2, 2),
        ]
        for i, layout in enumerate(layouts):  # every variant where ranks differ most, top-2 everywhere
            for name in VARIANTS if i in (1, 3) else ["top2"]:
                check(name, torch.float32, *layout)
        check("bf16_grouped", torch.bfloat16, *layouts[1])
        if rank == 0:
            print("all expert-parallel blocks match", file=sys.stderr)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
