"""MoE layer: tokens/s of tessera's MoE against HF transformers' MixtralSparseMoeBlock, and all-to-all bytes.

    python benchmarks/moe.py        # Mixtral-like (8 experts of 1024, top-2) and fine-grained (64 of 256, top-6)
    python benchmarks/moe.py --shapes 256x512x8x2 --tokens 2048 --rounds 3   # quicker: DIMxHIDDENxEXPERTSxTOPK

Throughput: both layers get the same router and expert weights (outputs checked equal first) and
the same tokens; a step is forward + backward of ``sum(out^2)``. Rounds alternate between the two
so machine noise hits both alike; the table shows the median tokens/s over rounds and the
spread (max/min), in fp32 (tessera loops over experts) and in bf16 weights and activations
(tessera's grouped matmul, ``torch._grouped_mm``). HF runs its default (eager) experts, and, where
this transformers has it, its own grouped_mm implementation as a second peer, and torchtitan's MoE
(its ``GroupedExperts``: ``torch._grouped_mm`` in bf16 whatever the input's dtype) when installed. Prints
``ratio=<tessera/HF eager>`` per shape and precision (above 1 means tessera is faster). With few
wide experts both sides are matmul-bound on a CPU; with many narrow ones HF's per-expert loop
and its per-expert gradient accumulation dominate.

All-to-all bytes: the (last) layer shape under expert parallelism on ``ep`` gloo processes (2 and 4);
every element an ``all_to_all_single`` of the forward and of the backward sends is counted, next
to the formula ``2 x tokens x top_k x dim x bytes`` per direction (dispatch and combine; tokens
over all ranks) and with capacity dropping, which sends only the kept rows. Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import model_config
from tessera.model.moe import MoE


def _tessera(args: argparse.Namespace, capacity: float = 0.0) -> MoE:
    cfg = model_config(
        vocab_size=300,
        dim=args.dim,
        n_heads=4,
        moe_experts=args.experts,
        moe_top_k=args.top_k,
        moe_ffn_hidden=args.hidden,
        moe_capacity_factor=capacity,
    )
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe


def _hf(args: argparse.Namespace, ours: MoE, implementation: str | None) -> torch.nn.Module:
    """MixtralSparseMoeBlock holding ``ours``'s weights (HF stores [gate; up] transposed, per expert)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=args.dim,
        intermediate_size=args.hidden,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        router_jitter_noise=0.0,
    )
    if implementation is not None:
        cfg._experts_implementation = implementation
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        e = ours.experts
        block.experts.gate_up_proj.copy_(torch.cat([e.gate_proj, e.up_proj], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(e.down_proj.transpose(1, 2))
    return block


def _torchtitan(args: argparse.Namespace, ours: MoE) -> torch.nn.Module | None:
    """torchtitan's MoE (softmax router, top-k scores renormalized as Mixtral's, no load-balance buffer) with its
    ``GroupedExperts`` (``torch._grouped_mm``, always in bf16) holding ``ours``'s weights; None when not installed."""
    try:
        from torchtitan.models.common.config_utils import make_router_config
        from torchtitan.models.common.moe import GroupedExperts, MoE as TitanMoE, RoutedExperts
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except ImportError:
        return None
    router = make_router_config(
        dim=args.dim, num_experts=args.experts, gate_param_init={}, top_k=args.top_k, score_func="softmax",
        route_norm=True,
    )  # fmt: skip
    experts = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=args.experts, top_k=args.top_k),
    )
    block = TitanMoE.Config(num_experts=args.experts, router=router, routed_experts=experts, load_balance_coeff=None)
    block = block.build()
    with torch.no_grad():
        block.router.gate.weight.copy_(ours.router.weight)
        e, theirs = ours.experts, block.routed_experts.inner_experts
        theirs.w1_EFD.copy_(e.gate_proj.transpose(1, 2))
        theirs.w3_EFD.copy_(e.up_proj.transpose(1, 2))
        theirs.w2_EDF.copy_(e.down_proj.transpose(1, 2))
    return block


def _step(module: torch.nn.Module, x: torch.Tensor) -> None:
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).sum().backward()
    module.zero_grad(set_to_none=True)


def _tokens_per_s(module: torch.nn.Module, x: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        _step(module, x)
    return x.shape[0] * x.shape[1] * iters / (time.perf_counter() - start)


def _hf_grouped_available() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return "grouped_mm" in ALL_EXPERTS_FUNCTIONS


def throughput(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, list[float]]:
    """Tokens/s per layer and round, after checking that the layers compute the same outputs."""
    ours = _tessera(args)
    peers = {"tessera": ours, "hf eager": _hf(args, ours, None)}
    if _hf_grouped_available():
        peers["hf grouped_mm"] = _hf(args, ours, "grouped_mm")
    titan = _torchtitan(args, ours)
    x = torch.randn(1, args.tokens, args.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours(x)
        for name, module in peers.items():
            got = module(x)
            got = got[0] if isinstance(got, tuple) else got
            assert torch.allclose(got, want, atol=1e-4), f"{name} computes another function"
        if titan is not None:  # its experts compute in bf16 whatever the weights' dtype: bf16 rounding apart
            assert torch.allclose(titan(x), want, atol=2e-2, rtol=5e-2), "torchtitan computes another function"
            peers["torchtitan grouped_mm"] = titan
    peers = {name: module.to(dtype) for name, module in peers.items()}
    x = x.to(dtype).requires_grad_()  # as inside a model: the input's gradient is computed too
    for module in peers.values():
        _step(module, x)  # warm up
    rates: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(args.rounds):
        for name, module in peers.items():
            rates[name].append(_tokens_per_s(module, x, args.iters))
    return rates


class _AllToAllBytes(TorchDispatchMode):
    """Bytes this process sends through all_to_all_single (rows to itself included), per call kind."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        name = func._overloadpacket.__name__
        # Only the token rows: the per-expert counts are integers.
        if func.namespace == "_c10d_functional" and name == "all_to_all_single" and args[0].is_floating_point():
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _a2a_worker(rank: int, ep: int, port: int, args: argparse.Namespace, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tessera.parallel.expert import apply_expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ep)
    try:
        mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
        tokens = args.a2a_tokens // ep
        for dtype in (torch.float32, torch.bfloat16):
            for capacity in (0.0, 1.0):
                moe = _tessera(args, capacity).to(dtype)
                apply_expert_parallel(moe, mesh)
                x = torch.randn(1, tokens, args.dim, generator=torch.Generator().manual_seed(rank)).to(dtype)
                x.requires_grad_()
                fwd, bwd = _AllToAllBytes(), _AllToAllBytes()
                with fwd:
                    out = moe(x)
                with bwd:
                    out.float().pow(2).sum().backward()
                sent = torch.tensor([fwd.bytes, bwd.bytes], dtype=torch.float64)
                dist.all_reduce(sent)
                if rank == 0:
                    queue.put((ep, str(dtype).removeprefix("torch."), capacity, *sent.tolist()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_to_all_bytes(args: argparse.Namespace) -> None:
    """Print measured all-to-all bytes per direction next to the formula, for ep = 2 and 4."""
    print("\n| ep | dtype | capacity | forward bytes | backward bytes | formula per direction | measured / formula |")
    print("|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for ep in (2, 4):
        queue = ctx.Queue()
        mp.spawn(_a2a_worker, args=(ep, _free_port(), args, queue), nprocs=ep)
        while not queue.empty():
            ep_, dtype, capacity, fwd, bwd = queue.get()
            size = 4 if dtype == "float32" else 2
            formula = 2 * args.a2a_tokens * args.top_k * args.dim * size
            label = "dropless" if capacity == 0 else f"{capacity:g}"
            print(f"| {ep_} | {dtype} | {label} | {fwd:,.0f} | {bwd:,.0f} | {formula:,} | {fwd / formula:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="512x1024x8x2,512x256x64x6", help="DIMxHIDDENxEXPERTSxTOPK, comma-separated"
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per throughput step")
    parser.add_argument("--a2a-tokens", type=int, default=1024, help="tokens over all ranks for the byte count")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3, help="steps per round")
    parser.add_argument("--skip-a2a", action="store_true", help="throughput only (no gloo processes)")
    args = parser.parse_args()
    print("| shape (dim x hidden x experts x top-k) | dtype | layer | tokens/s (median) | spread (max/min) |")
    print("|---|---|---|---|---|")
    ratios = []
    for shape in args.shapes.split(","):
        args.dim, args.hidden, args.experts, args.top_k = map(int, shape.split("x"))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            rates = throughput(args, dtype)
            for layer, values in rates.items():
                median, spread = statistics.median(values), max(values) / min(values)
                print(f"| {shape} | {name} | {layer} | {median:,.0f} | {spread:.2f} |")
            ratio = statistics.median(rates["tessera"]) / statistics.median(rates["hf eager"])
            titan = rates.get("torchtitan grouped_mm")
            versus = f", tessera/torchtitan={statistics.median(rates['tessera']) / statistics.median(titan):.3f}"
            ratios.append(f"{shape} {name}: ratio={ratio:.3f}" + (versus if titan else ""))
    print("\n" + "\n".join(ratios))
    if not args.skip_a2a:
        all_to_all_bytes(args)


if __name__ == "__main__":
    main()
