"""Under torchrun (2 ranks): every TP-sharded block's outputs and gradients equal the unsharded block's.

For a dense and a MoE decoder (the MoE one with Qwen3's per-head QK-norm), latent attention, QK-norm over all heads, and
the recurrent mixers (Mamba-1, Mamba-2, Gated DeltaNet, with the linear kernels' attention layers), with and without
sequence parallelism, the sharded copy of a
model and the original see the same tokens; each block's output (hooked) and every parameter
gradient are compared after a forward and backward through the loss.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distexit import run_and_exit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from tessera.config import ModelConfig, model_config
from tessera.model import build_model
from tessera.parallel.tensor import apply_tensor_parallel

ATOL, RTOL = 1e-5, 1e-4


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _capture(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    outputs: dict[str, torch.Tensor] = {}
    for name, block in model.layers.items():
        block.register_forward_hook(lambda _m, _a, out, name=name: outputs.__setitem__(name, _full(out).detach()))
    return outputs


def check(cfg: ModelConfig, sp: bool, mesh) -> None:
    torch.manual_seed(0)
    ref = build_model(cfg)
    tp = copy.deepcopy(ref)
    apply_tensor_parallel(tp, mesh, sp)
    ref_out, tp_out = _capture(ref), _capture(tp)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten()).backward()
    with loss_parallel():
        F.cross_entropy(tp(tokens).flatten(0, 1), labels.flatten()).backward()
    where = (
        f"moe={cfg.moe.experts} mla={cfg.mla.kv_rank}/{cfg.mla.q_rank} qk_norm={cfg.attention.qk_norm} "
        f"pattern={cfg.layer_pattern} mamba={cfg.mamba.version} sp={sp}"
    )
    for name in ref_out:
        torch.testing.assert_close(
            tp_out[name], ref_out[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{where} block {name} output: {m}"
        )
    tp_params = dict(tp.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            _full(tp_params[name].grad), p.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where} grad {name}: {m}"
        )
    sharded = sum(isinstance(p, DTensor) and p.placements[0].is_shard() for p in tp.parameters())
    assert sharded >= 4 * cfg.n_layers // (2 if cfg.moe.experts else 1), (
        f"{where}: only {sharded} parameters are sharded"
    )


def check_collectives(mesh) -> None:
    """One block issues Megatron's collectives: 2 all-reduces each way, or 2 all-gather + 2 reduce-scatter with SP."""
    from tessera.parallel.comms import CollectiveCounter

    expected = {False: {"all_reduce": 2}, True: {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}}
    for sp in (False, True):
        torch.manual_seed(0)
        model = build_model(
            model_config(vocab_size=256, dim=64, n_layers=1, n_heads=4, max_seq_len=32, tie_embeddings=False)
        )
        apply_tensor_parallel(model, mesh, sp)
        x = torch.randn(2, 16, 64)
        if sp:
            x = DTensor.from_local(x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()], mesh, (Shard(1),))
        fwd, bwd = CollectiveCounter(), CollectiveCounter()
        with fwd:
            y = model.layers["0"](x, model.context(2, 16, 0, None, None, torch.device("cpu")))
        y = y.full_tensor() if isinstance(y, DTensor) else y
        with bwd:
            y.pow(2).mean().backward()
        assert dict(fwd.counts) == expected[sp], f"sp={sp} forward collectives {dict(fwd.counts)}"
        assert dict(bwd.counts) == expected[sp], f"sp={sp} backward collectives {dict(bwd.counts)}"


def attention_variants() -> list[ModelConfig]:
    """Latent attention (with and without the query bottleneck; its RoPE key is shared by every rank's
    heads) and QK-norm over all heads (its statistics span every rank's channels)."""
    base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32, tie_embeddings=False)
    mla = {"kv_rank": 16, "rope_head_dim": 8, "nope_head_dim": 8, "v_head_dim": 12}
    return [
        model_config(**base, mla={**mla, "q_rank": 24}),
        model_config(**base, mla=mla),
        model_config(**base, n_kv_heads=2, attention={"qk_norm": True, "qk_norm_scope": "all"}),
    ]


def recurrent_variants() -> list[ModelConfig]:
    """Mamba-1 (Jamba's dt/B/C norms, projection biases: x_proj's output summed over the ranks, the output bias
    added once) with Performer attention, Mamba-2 (two B/C groups, one per rank; its gated norm per group) with
    elu+1 attention, and Gated DeltaNet; spread-out weights (std 0.2) so a missing reduction shows."""
    base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32, tie_embeddings=False, init_std=0.2)
    mamba = {"state": 8, "head_dim": 16, "chunk": 8, "proj_bias": True}
    gdn = {"key_heads": 2, "value_heads": 4, "key_head_dim": 16, "value_head_dim": 16, "chunk": 8}
    return [
        model_config(**base, layer_pattern="MA", mamba={**mamba, "dt_norm": True}, attention={"kernel": "performer"}),
        model_config(
            **base, layer_pattern="MA", mamba={**mamba, "version": 2, "groups": 2}, attention={"kernel": "linear"}
        ),
        model_config(**base, layer_pattern="DA", gdn=gdn),
    ]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    try:
        dense = model_config(
            vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, tie_embeddings=False
        )
        moe = model_config(
            vocab_size=256,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            max_seq_len=32,
            moe_experts=4,
            moe_top_k=2,
            attention={"qk_norm": True},  # Qwen3-MoE: per-head QK-norm, one weight shared by the tp ranks' heads
            tie_embeddings=False,
        )
        for cfg in (dense, moe, *attention_variants(), *recurrent_variants()):
            for sp in (False, True):
                check(cfg, sp, mesh)
        check_collectives(mesh)
        if dist.get_rank() == 0:
            print("all blocks match", file=sys.stderr)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
