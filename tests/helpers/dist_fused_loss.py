"""Under torchrun (2 ranks): the fused vocab-parallel head + loss equals the plain loss on full logits.

A tensor-parallel copy of a model (vocab-sharded head, with and without sequence parallelism)
computes its loss through :class:`tessera.train.loss.FusedHeadLoss` in small chunks; the
unsharded original computes ``lm_loss`` on its materialized logits. Loss and every parameter
gradient must agree (fp32, 1e-5). Covers a causal decoder with an odd vocabulary (uneven
shards) and label smoothing, and a BERT-style encoder (tied head with a bias, masked loss).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from distexit import run_and_exit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tessera.config import model_config
from tessera.model import build_model
from tessera.parallel.tensor import apply_tensor_parallel
from tessera.train.loss import FusedHeadLoss, lm_loss

RTOL, ATOL = 1e-5, 1e-6


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check(cfg, sp: bool, mesh, smoothing: float, masked: bool) -> None:
    torch.manual_seed(0)
    ref = build_model(cfg)
    tp = copy.deepcopy(ref)
    apply_tensor_parallel(tp, mesh, sp)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    mask = torch.rand(2, 16, generator=gen) > 0.4 if masked else None
    want = lm_loss(ref(tokens), labels, smoothing, mask)
    want.backward()
    got = tp(tokens, output_fn=FusedHeadLoss(labels, mask, smoothing, chunk=5))
    got.backward()
    where = f"{cfg.arch} sp={sp}"
    assert not isinstance(got, DTensor), f"{where}: the fused loss should be a plain tensor"
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    tp_params = dict(tp.named_parameters())
    for name, p in ref.named_parameters():
        grad = _full(tp_params[name].grad)
        torch.testing.assert_close(
            grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{where} grad {name}: {m}"
        )


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    shape = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    decoder = model_config(vocab_size=97, **shape)
    encoder = model_config(arch="encoder", vocab_size=96, tie_embeddings=True, norm="layernorm", **shape)
    for sp in (False, True):
        check(decoder, sp, mesh, smoothing=0.1, masked=False)
        check(encoder, sp, mesh, smoothing=0.0, masked=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print("fused vocab-parallel loss: ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)
