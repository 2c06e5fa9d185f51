"""Test driver run under torchrun (4 processes): context-parallel model forward/backward against one process.

    torchrun --nproc-per-node 4 tests/helpers/dist_cp.py OUT.json

For cp = 2 (two groups of 2 ranks) and cp = 4, each attention method, with and without document
masks and with windowed kernels, a tiny decoder runs on this rank's zigzag slice; the summed loss
and the gradients summed over the cp group (what FSDP's reduction over dp_shard x cp does after the
loss is scaled by cp) are compared with the same model run on the whole sequence in one process.
Negative controls break the recipe on purpose (local RoPE positions; a local loss mean; the recurrent
mixers' cross-rank state or convolution halo dropped) and must be far off. Rank 0 writes every case's max errors to OUT.json.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distexit import run_and_exit
from torch.distributed.device_mesh import init_device_mesh

from tessera.config import model_config
from tessera.model import MoELog, build_model, moe_loss
from tessera.model.sinks import AttentionSinks
from tessera.parallel import context as cp_module
from tessera.parallel.context import apply_context_parallel, loss_scale, shard_batch

T, B, V = 32, 2, 64


def _batch(seed: int, documents: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)
    loss_mask = torch.rand(B, T, generator=gen) > 0.3
    kwargs = {}
    if documents:
        doc = torch.tensor([[0] * 9 + [1] * 15 + [2] * 8, [0] * 20 + [1] * 12])
        start = torch.cat([torch.ones(B, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
        seq = torch.arange(T).expand(B, T)
        kwargs = {"positions": seq - torch.cummax(torch.where(start, seq, 0), 1).values, "document_ids": doc}
    return tokens[:, :-1], tokens[:, 1:], loss_mask, kwargs


def _loss_sum(model, inputs, labels, loss_mask, kwargs) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The summed masked token loss and the MoE layers' losses (0 without MoE)."""
    log = MoELog()
    logits = model(inputs, **kwargs, moe_log=log)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    aux = moe_loss(log)
    return (losses * loss_mask.flatten()).sum(), 0.0 if aux is None else aux


def run_case(mesh, method: str, documents: bool, model_kw: dict, bug: str = "") -> dict[str, float]:
    """Relative error of the loss and of every gradient (max |diff| / max |reference|), CP against one process."""
    torch.manual_seed(0)
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.2)
    cfg = model_config(**{**base, **model_kw})
    ref = build_model(cfg)
    for module in ref.modules():  # attention sinks start at 0: draw them, so each head's differs
        if isinstance(module, AttentionSinks):
            torch.nn.init.normal_(module.weight, std=1.0)
    inputs, labels, loss_mask, kwargs = _batch(1, documents)
    ref_sum, ref_aux = _loss_sum(ref, inputs, labels, loss_mask, kwargs)
    ref_loss = ref_sum / loss_mask.sum() + ref_aux
    ref_loss.backward()
    cp = copy.deepcopy(ref)
    cp.zero_grad()
    apply_context_parallel(cp, mesh, method)
    if bug == "no_state":  # the recurrent mixers' state does not cross to the next rank
        cp.sequence_split.entering_states = lambda a, h, elementwise=False: torch.zeros_like(h)
    if bug == "no_halo":  # the convolutions' windows start at each piece
        cp.sequence_split.halos = torch.zeros_like
    if bug == "local_positions":
        cp.sequence_split.positions = lambda length, device: torch.arange(length, device=device)[None]
    if bug == "local_bias_keys":  # the score bias over this rank's keys only
        cp.sequence_split.key_positions = lambda length, device: cp.sequence_split.positions(length, device).repeat(
            1, mesh.size()
        )
    (x,), kw, y, m = shard_batch((inputs,), kwargs, labels, loss_mask, mesh)
    if bug == "local_expert_counts":
        for module in cp.modules():
            if hasattr(module, "token_group"):
                local = type(module.token_group)(mesh.size(), lambda t: t * mesh.size())
                module.token_group = module.batch_group = local  # both scopes' groups count local tokens only
    local_sum, aux = _loss_sum(cp, x, y, m, kw)
    scale = 1.0 if bug == "local_mean" else loss_scale(y, m, mesh)  # cp * local / global tokens
    loss = local_sum / m.sum() * scale + aux  # MoE losses: already cp x this rank's share
    loss.backward()
    group = mesh.get_group()
    total = loss.detach() / mesh.size()  # FSDP averages over cp: the loss likewise
    dist.all_reduce(total, group=group)
    errors = {"loss": ((total - ref_loss.detach()).abs() / ref_loss.abs()).item()}
    ref_grads = dict(ref.named_parameters())
    for name, p in cp.named_parameters():
        grad = p.grad.clone() / mesh.size()
        dist.all_reduce(grad, group=group)
        want = ref_grads[name].grad
        errors[name] = ((grad - want).abs().max() / want.abs().max()).item()
    return errors


def _sink_cases(cases: dict, meshes: dict) -> None:
    """Attention sinks (gpt-oss: alternating windowed and global layers) under both methods, and the sink
    entered once per rank instead of once (the ring's log-sum-exp started at sink + log cp) as a negative control."""
    sinks = {"layer_pattern": "AG", "attention": {"sinks": True, "sliding_window": 5}}
    cases["cp2_ring_sinks_window_docs"] = run_case(meshes["cp2"], "ring", True, sinks)
    cases["cp4_ring_sinks_window"] = run_case(meshes["cp4"], "ring", False, sinks)
    cases["cp2_allgather_sinks_window_docs"] = run_case(meshes["cp2"], "allgather", True, sinks)
    cases["cp4_allgather_sinks_eager"] = run_case(
        meshes["cp4"], "allgather", False, {"attention": {"sinks": True, "kernel": "eager"}}
    )
    start = cp_module.ring_start
    cp_module.ring_start = lambda s, shape: start(s, shape) + math.log(meshes["cp2"].size())
    try:
        cases["bug_sink_per_rank"] = run_case(meshes["cp2"], "ring", False, sinks)
    finally:
        cp_module.ring_start = start


# Recurrent mixers: Mamba-2 with elu+1 attention, Mamba-1 with Performer, Gated DeltaNet (scan chunks of 4).
MAMBA = {"state": 4, "head_dim": 16, "chunk": 4}
GDN = {"key_heads": 2, "value_heads": 4, "key_head_dim": 8, "value_head_dim": 8, "chunk": 4}
RECURRENT = {
    "mamba2_linear": {"layer_pattern": "MA", "mamba": {**MAMBA, "version": 2}, "attention": {"kernel": "linear"}},
    "mamba_performer": {"layer_pattern": "MA", "mamba": MAMBA, "attention": {"kernel": "performer"}},
    "mamba2": {"layer_pattern": "MA", "mamba": {**MAMBA, "version": 2}},
    "mamba": {"layer_pattern": "MA", "mamba": MAMBA},
    "gdn": {"layer_pattern": "DA", "gdn": GDN},
}


def _recurrent_cases(cases: dict, meshes: dict) -> None:
    """Each recurrent mixer at cp2, three of them at cp4, with document masks where the mixer has them (the linear
    kernels have none; without documents the mixers run in the linear-kernel models and in the run-level world of
    tests/integration/test_gated_deltanet_parallel.py), and the cross-rank state and the convolution halo dropped on
    purpose."""
    plan = {
        "cp2": ("mamba2_linear", "mamba_performer", "mamba2", "mamba", "gdn"),
        "cp4": ("mamba2_linear", "mamba", "gdn"),
    }
    for mesh_name, names in plan.items():
        for name in names:
            documents = "kernel" not in RECURRENT[name].get("attention", {})
            case = f"{mesh_name}_recurrent_{name}{'_docs' if documents else ''}"
            cases[case] = run_case(meshes[mesh_name], "allgather", documents, RECURRENT[name])
    cp2 = meshes["cp2"]
    cases["bug_recurrent_no_state"] = run_case(cp2, "allgather", False, RECURRENT["mamba2_linear"], "no_state")
    cases["bug_recurrent_no_halo"] = run_case(cp2, "allgather", True, RECURRENT["mamba"], "no_halo")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = sys.argv[1]
    world = dist.get_world_size()
    meshes = {"cp4": init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]}
    meshes["cp2"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    window = {"attention": {"sliding_window": 5}}
    cases = {}
    for mesh_name, mesh in meshes.items():
        for method in ("allgather", "ring"):
            for documents in (False, True):
                name = f"{mesh_name}_{method}_{'docs' if documents else 'nodocs'}"
                cases[name] = run_case(mesh, method, documents, {})
            cases[f"{mesh_name}_{method}_window_docs"] = run_case(mesh, method, True, window)
    mesh = meshes["cp2"]
    cases["cp2_allgather_bigbird"] = run_case(
        mesh, "allgather", False, {"attention": {"kernel": "bigbird", "block_size": 4, "global_tokens": 2}}
    )
    cases["cp2_ring_longformer_encoder"] = run_case(
        mesh, "ring", True, {"arch": "encoder", "attention": {"kernel": "longformer", "sliding_window": 3}}
    )
    cases["cp2_ring_window_and_global_layers"] = run_case(
        mesh, "ring", True, {"layer_pattern": "AG", "attention": {"sliding_window": 5}}
    )
    alibi, t5 = (
        {"position": {"kind": "alibi"}},
        {"position": {"kind": "t5_bias", "rel_buckets": 8, "rel_max_distance": 16}},
    )
    cases["cp2_allgather_alibi_docs"] = run_case(mesh, "allgather", True, alibi)
    cases["cp4_allgather_alibi_eager_window"] = run_case(
        meshes["cp4"], "allgather", False, {**alibi, "attention": {"kernel": "eager", "sliding_window": 5}}
    )
    cases["cp4_allgather_t5_docs"] = run_case(meshes["cp4"], "allgather", True, t5)
    cases["cp2_allgather_t5_encoder"] = run_case(mesh, "allgather", False, {**t5, "arch": "encoder"})
    cases["cp2_allgather_learned_positions"] = run_case(mesh, "allgather", False, {"position": {"kind": "learned"}})
    moe = {"moe": {"experts": 4, "top_k": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}}
    deepseek = {
        "moe": {
            "experts": 4,
            "top_k": 2,
            "router": "sigmoid",
            "aux_loss_scope": "sequence",
            "aux_loss_coef": 0.1,
            "expert_bias": True,
            "shared_experts": 1,
        }
    }
    cases["cp2_allgather_moe"] = run_case(mesh, "allgather", False, moe)
    cases["cp4_ring_moe_docs"] = run_case(meshes["cp4"], "ring", True, moe)
    cases["cp2_allgather_moe_deepseek_docs"] = run_case(mesh, "allgather", True, deepseek)
    cases["bug_local_expert_counts"] = run_case(mesh, "allgather", False, moe, bug="local_expert_counts")
    cases["bug_local_positions"] = run_case(mesh, "ring", False, {}, bug="local_positions")
    cases["bug_local_bias_keys"] = run_case(mesh, "allgather", False, alibi, bug="local_bias_keys")
    cases["bug_local_mean"] = run_case(mesh, "allgather", True, {}, bug="local_mean")
    _sink_cases(cases, meshes)
    _recurrent_cases(cases, meshes)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(cases, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
