"""Training throughput of tessera's decoder against HF transformers' LlamaForCausalLM.

Both models have the same Llama shape, random weights, the same AdamW and the same batches;
each step is forward + cross-entropy + backward + optimizer step. Rounds alternate between the
two so machine noise hits both alike. Prints tokens/s per framework and, per precision,
``ratio=<tessera/HF>`` (above 1 means tessera is faster).

    python benchmarks/throughput.py                  # the issue's shape: dim 512, 8 layers, seq 512, batch 8
    python benchmarks/throughput.py --dim 256 --layers 4 --seq 256   # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from tessera.config import model_config
from tessera.model import build_model


def _tessera(args: argparse.Namespace) -> torch.nn.Module:
    cfg = model_config(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn, max_seq_len=args.seq, norm_eps=1e-5,
    )
    return build_model(cfg)


def _hf(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def _step_fn(model: torch.nn.Module, is_hf: bool, dtype: torch.dtype, device: torch.device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext

    def step(batch: torch.Tensor) -> None:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with autocast():
            logits = model(input_ids=inputs).logits if is_hf else model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _time(step, batches: list[torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace, dtype_name: str) -> tuple[float, float]:
    """Tokens/s of tessera and HF at one precision."""
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    models = {"tessera": _tessera(args).to(device), "hf": _hf(args).to(device)}
    steps = {name: _step_fn(m, name == "hf", dtype, device) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device) for _ in range(args.steps)]
    for name in steps:  # warm up kernels, allocator and optimizer state
        _time(steps[name], batches[: args.warmup], device)
    seconds = {name: 0.0 for name in steps}
    for _ in range(args.rounds):
        for name in steps:
            seconds[name] += _time(steps[name], batches, device)
    tokens = args.rounds * args.steps * args.batch * args.seq
    return tokens / seconds["tessera"], tokens / seconds["hf"]


def main() -> None:
    """Parse the shape, run both precisions, print the table and the ratios."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} shape: dim={args.dim} layers={args.layers} "
          f"heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} seq={args.seq} batch={args.batch}")
    for dtype_name in args.dtypes.split(","):
        ours, theirs = run(args, dtype_name)
        print(f"{dtype_name}: tessera {ours:,.0f} tok/s | hf {theirs:,.0f} tok/s | ratio={ours / theirs:.3f}")


if __name__ == "__main__":
    main()
