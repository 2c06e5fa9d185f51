"""Long context: block-sparse attention vs dense masks, and context parallelism's memory per rank.

Part ``sparse``: one attention core (B=1, 4 query heads, 2 KV heads, head_dim 16, causal), forward
and backward, at lengths 1k..32k, for each windowed pattern (sliding window 512; Longformer 512 +
16 global tokens; BigBird blocks of 64, 3 random blocks, 64 global tokens) computed block-sparse
(tessera's kernel) and as its dense-mask reference (the same pattern as an sdpa mask, what tessera
did before). Peak memory of the core (tensors live beyond its inputs, tracked by torch's
MemTracker) and time (median and spread of interleaved rounds) per length; the growth exponent is
the least-squares slope of log(memory) and log(time) against log(length) from 2k up.

Part ``cp``: a tiny decoder (dim 64, 2 layers, 4 heads, 2 KV heads) trains one step on one
sequence of 8k, 16k and 32k tokens with cp = 1, 2, 4 (torchrun on this machine) and each cp method.
Per rank: the activations saved for backward outside the attention core (per-token work, which
should be (cp=1 bytes) / cp; that formula and the ratio are printed), those of the attention core
(all-gather keeps the gathered K/V and a local x global mask; ring keeps only local tensors), the
peak of all activations and temporaries, and tokens/s of the whole job.

Part ``dsa``: DeepSeek Sparse Attention's core (tessera/model/dsa.py: each query attends to the
``--topk`` keys its lightning indexer picks, gathered per chunk of queries, kv_b_proj absorbed) against
dense causal latent attention through sdpa (the CPU flash kernel: O(length) memory, O(length^2) work),
forward and backward, B=1, 4 heads, kv_rank 64, nope 32 + rope 16, v 32, at 8k..32k. The indexer's
top-k selection (4 heads of 32, chunked, no gradient) is timed on its own.

    python benchmarks/long_context.py [sparse|cp|dsa|all] [--lengths ...] [--rounds 3] [--topk 512]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

GIB = 2**30
SPARSE_SPECS = {
    "window": dict(kernel="sdpa", window=512),
    "longformer": dict(kernel="longformer", window=512, global_tokens=16),
    "bigbird": dict(kernel="bigbird", block_size=64, random_blocks=3, global_tokens=64),
}
DENSE_LIMIT = 16384  # the dense reference at 32k needs ~17 GiB (scores and a float mask); skipped
# CPU sdpa takes its math path for latent attention's unequal q/k and v widths: 3 x heads x length^2 fp32
# scores (12 GiB at 16k); longer dense runs are skipped unless --dense-limit is raised.
DSA_DENSE_LIMIT = 8192


def _peak_bytes(fn, external: tuple[torch.Tensor, ...]) -> int:
    """Peak bytes of activations and temporaries while ``fn`` runs (parameters, gradients and
    ``external`` inputs excluded)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        fn()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return sum(v for k, v in peak.items() if getattr(k, "value", k) in ("Activation", "Temp", "Other"))


def _core(name: str, length: int, sparse: bool):
    """A closure running one attention core forward and backward, and its inputs."""
    from tessera.model.attention import block_sparse_attention
    from tessera.model.masks import MaskSpec, attention_mask, block_layout

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, length, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, length, 16, generator=gen, requires_grad=True) for _ in range(2))
    spec = MaskSpec(causal=True, max_len=length, **SPARSE_SPECS[name])

    def run() -> None:
        if sparse:
            out = block_sparse_attention(q, k, v, block_layout(spec, length, q.device), 0.25)
        else:
            mask = attention_mask(spec, length, length, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
        out.sum().backward()

    return run, (q, k, v)


def _fit(lengths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(length)."""
    xs, ys = [math.log(n) for n in lengths], [math.log(v) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _measure(name: str, length: int, sparse: bool, rounds: int) -> tuple[int, list[float]]:
    run, inputs = _core(name, length, sparse)
    memory = _peak_bytes(run, inputs)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return memory, times


def sparse_part(lengths: list[int], rounds: int) -> None:
    """Memory and time of each pattern, block-sparse vs dense mask, and the fitted exponents."""
    print("## block-sparse vs dense-mask attention (one core, fwd+bwd, causal)")
    print("| pattern | length | sparse MiB | dense MiB | dense/sparse | sparse s (median, spread) | dense s |")
    print("|---|---|---|---|---|---|---|")
    for name in SPARSE_SPECS:
        fits: dict[str, list[tuple[int, float, float]]] = {"sparse": [], "dense": []}
        for length in lengths:
            row = {}
            for sparse in (True, False):  # interleaved: each length measures both before moving on
                if not sparse and length > DENSE_LIMIT:
                    continue
                memory, times = _measure(name, length, sparse, rounds)
                row[sparse] = (memory, times)
                fits["sparse" if sparse else "dense"].append((length, memory, statistics.median(times)))
            print(_sparse_row(name, length, row), flush=True)
        for kind, points in fits.items():
            big = [p for p in points if p[0] >= 2048]
            if len(big) >= 2:
                n = [p[0] for p in big]
                print(
                    f"- {name} {kind}: memory ~ length^{_fit(n, [p[1] for p in big]):.2f}, "
                    f"time ~ length^{_fit(n, [p[2] for p in big]):.2f} ({n[0]}..{n[-1]})"
                )


def _sparse_row(name: str, length: int, row: dict) -> str:
    (smem, stimes) = row[True]
    dense = row.get(False)
    spread = max(stimes) - min(stimes)
    cells = [name, str(length), f"{smem / 2**20:.1f}"]
    if dense is None:
        cells += ["skipped", "", f"{statistics.median(stimes):.3f} ({spread:.3f})", ""]
    else:
        dmem, dtimes = dense
        cells += [
            f"{dmem / 2**20:.1f}",
            f"{dmem / smem:.1f}",
            f"{statistics.median(stimes):.3f} ({spread:.3f})",
            f"{statistics.median(dtimes):.3f}",
        ]
    return "| " + " | ".join(cells) + " |"


# ----------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention


def _dsa_layer(topk: int):
    from tessera.config import model_config
    from tessera.model import build_model

    mla = {"kv_rank": 64, "q_rank": 64, "rope_head_dim": 16, "nope_head_dim": 32, "v_head_dim": 32}
    dsa = {"topk": topk, "index_heads": 4, "index_head_dim": 32}
    cfg = model_config(vocab_size=64, dim=64, n_layers=1, n_heads=4, max_seq_len=32768, mla=mla, dsa=dsa)
    torch.manual_seed(0)
    return build_model(cfg)


def _dsa_inputs(model, length: int):
    """Queries, latents and RoPE keys of one random sequence, and the indexer's top-k (timed)."""
    attn, gen = model.layers["0"].attention, torch.Generator().manual_seed(0)
    ctx = model.context(1, length, 0, None, None, torch.device("cpu"))
    x = torch.randn(1, length, 64, generator=gen)
    q_nope = torch.randn(1, 4, length, 32, generator=gen, requires_grad=True)
    q_rope = torch.randn(1, 4, length, 16, generator=gen, requires_grad=True)
    latent = torch.randn(1, length, 64, generator=gen, requires_grad=True)
    k_rope = torch.randn(1, length, 16, generator=gen, requires_grad=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        iq, iw = attn.indexer.queries(x, q_resid, ctx)
        allowed = torch.ones(length, length, dtype=torch.bool).tril()[None]
        idx, valid = attn.indexer.select(iq, iw, attn.indexer.keys(x, ctx), allowed, attn.topk)
    return attn, ctx, (q_nope, q_rope, latent, k_rope), idx, valid, time.perf_counter() - t0


def dsa_part(lengths: list[int], rounds: int, topk: int, dense_limit: int = DSA_DENSE_LIMIT) -> None:
    """Sparse core vs dense sdpa: peak activation memory and time per length (interleaved rounds)."""
    print(f"## DeepSeek sparse attention (top-{topk}) vs dense causal sdpa: one latent-attention core, fwd+bwd")
    print(
        "| length | sparse MiB | dense MiB | sparse s (median, spread) | dense s (median, spread) | dense/sparse time "
        "| indexer top-k s |"
    )
    print("|---|---|---|---|---|---|---|")
    model = _dsa_layer(topk)
    for length in lengths:
        attn, ctx, inputs, idx, valid, select_s = _dsa_inputs(model, length)
        runs = {"sparse": lambda: attn._sparse(*inputs, idx, valid)[0].sum().backward()}
        if length <= dense_limit:
            runs["dense"] = lambda: attn._dense(*inputs, ctx).sum().backward()
        memory = {name: _peak_bytes(run, inputs) for name, run in runs.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):  # interleaved: a load change hits both
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        print(_dsa_row(length, memory, times, select_s), flush=True)


def _dsa_row(length: int, memory: dict[str, int], times: dict[str, list[float]], select_s: float) -> str:
    cells = [str(length)]
    cells += [f"{memory[n] / 2**20:.1f}" if n in memory else "skipped" for n in ("sparse", "dense")]
    cells += [
        f"{statistics.median(times[n]):.3f} ({max(times[n]) - min(times[n]):.3f})" if n in times else ""
        for n in ("sparse", "dense")
    ]
    ratio = statistics.median(times["dense"]) / statistics.median(times["sparse"]) if "dense" in times else None
    cells += [f"{ratio:.2f}" if ratio else "", f"{select_s:.3f}"]
    return "| " + " | ".join(cells) + " |"


# ----------------------------------------------------------------------------------------------
# Context parallelism


@contextmanager
def _saved_bytes(counts: dict[str, int], where: list[str]):
    """Count bytes saved for backward, attributed to ``where[-1]`` at the time they are saved."""
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            counts[where[-1]] = counts.get(where[-1], 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _tag_attention(model, where: list[str]) -> None:
    """Attribute what the attention core (kernel, or context parallelism's attend) saves to "attention"."""
    from tessera.model.attention import Attention

    def tagged(fn):
        def run(*args, **kwargs):
            where.append("attention")
            try:
                return fn(*args, **kwargs)
            finally:
                where.pop()

        return run

    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = tagged(module.attend)
        split = getattr(module, "sequence_split", None)
        if split is not None and not getattr(split, "_tagged", False):
            attention = split.attention
            split.attention = lambda *a, _f=attention: tagged(_f(*a))
            split._tagged = True


def cp_worker(lengths: list[int], methods: list[str]) -> None:
    """One rank: for each length and method, one training step; rank 0 prints JSON lines."""
    import torch.distributed as dist

    from tessera.config import model_config
    from tessera.model import build_model
    from tessera.parallel.context import apply_context_parallel, loss_scale, shard_batch

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    for length in lengths:
        for method in methods if mesh is not None else ["none"]:
            torch.manual_seed(0)
            cfg = model_config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=length)
            model = build_model(cfg)
            if mesh is not None:
                apply_context_parallel(model, mesh, method)
            record = _cp_step(model, length, mesh, shard_batch, loss_scale)
            record.update(cp=world, method=method, length=length)
            if mesh is not None:
                stats = torch.tensor([record["peak"], record["seconds"]], dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                record["peak"], record["seconds"] = stats.tolist()
            if mesh is None or dist.get_rank() == 0:
                print("RESULT " + json.dumps(record), flush=True)
    if mesh is not None:
        dist.destroy_process_group()


def _cp_step(model, length: int, mesh, shard_batch, loss_scale) -> dict:
    """One forward/backward: saved bytes by part, peak activation memory, seconds."""
    tokens = torch.randint(0, 256, (1, length + 1), generator=torch.Generator().manual_seed(1))
    args, kwargs, labels, mask = (tokens[:, :-1],), {}, tokens[:, 1:], None
    if mesh is not None:
        args, kwargs, labels, mask = shard_batch(args, kwargs, labels, mask, mesh)
    where, counts = ["other"], {}
    _tag_attention(model, where)

    def step() -> None:
        with _saved_bytes(counts, where):
            logits = model(*args, **kwargs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            scale = loss_scale(labels, mask, mesh) if mesh is not None else 1.0
            (loss * scale).backward()

    t0 = time.perf_counter()
    peak = _peak_bytes(step, ())
    seconds = time.perf_counter() - t0
    return {
        "peak": peak,
        "seconds": seconds,
        "saved_other": counts.get("other", 0),
        "saved_attention": counts.get("attention", 0),
    }


def cp_part(lengths: list[int], cps: list[int], methods: list[str]) -> None:
    """Launch the cp workers and print the table."""
    results = []
    for cp in cps:
        args = [__file__, "cp-worker", "--lengths", ",".join(map(str, lengths)), "--methods", ",".join(methods)]
        cmd = (
            [sys.executable, *args]
            if cp == 1
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", *args]
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        # A gloo worker can abort at exit after its work is done (a known torch flake): keep complete output.
        if len(found) != len(lengths) * (len(methods) if cp > 1 else 1):
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"cp={cp} failed (exit {proc.returncode})")
        results += found
    _cp_table(results)


def _cp_table(results: list[dict]) -> None:
    print("## context parallelism: one training step of one sequence, per rank")
    print(
        "| length | cp | method | non-attention saved MiB | (cp=1)/cp MiB | ratio | attention saved MiB "
        "| peak act+temp MiB | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = {r["length"]: r for r in results if r["cp"] == 1}
    for r in sorted(results, key=lambda r: (r["length"], r["cp"], r["method"])):
        expect = base[r["length"]]["saved_other"] / r["cp"]
        cells = [
            r["length"],
            r["cp"],
            r["method"],
            f"{r['saved_other'] / 2**20:.1f}",
            f"{expect / 2**20:.1f}",
            f"{r['saved_other'] / expect:.3f}",
            f"{r['saved_attention'] / 2**20:.1f}",
            f"{r['peak'] / 2**20:.1f}",
            f"{r['length'] / r['seconds']:.0f}",
        ]
        print("| " + " | ".join(map(str, cells)) + " |")
    print("- expected non-attention activations per rank = (cp=1 bytes) / cp: every op outside attention is per token")


def main() -> None:
    """Run the parts asked for on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="?", default="all", choices=["all", "sparse", "cp", "dsa", "cp-worker"])
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--dense-limit", type=int, default=DSA_DENSE_LIMIT)
    parser.add_argument("--lengths", default="")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--methods", default="allgather,ring")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    methods = args.methods.split(",")
    if args.part == "cp-worker":
        return cp_worker(ints(args.lengths), methods)
    if args.part in ("all", "sparse"):
        sparse_part(ints(args.lengths) or [1024, 2048, 4096, 8192, 16384, 32768], args.rounds)
    if args.part in ("all", "dsa"):
        dsa_part(ints(args.lengths) or [8192, 16384, 32768], args.rounds, args.topk, args.dense_limit)
    if args.part in ("all", "cp"):
        cp_part(ints(args.lengths) or [8192, 16384, 32768], ints(args.cps), methods)


if __name__ == "__main__":
    main()
