"""One training step of tessera against every peer that is installed, same shape, same run.

The contenders train the same Llama shape (random init, fused AdamW for all, clipping at 1.0, bf16
by autocast or fp32) on the same pre-made batches, in a hand-written loop:

- ``tessera``: tessera's model, its final hidden states into the fused chunked head + loss
  (``train.fused_loss``, the trainer's default);
- ``tessera-full``: the same model, full logits into ``F.cross_entropy``;
- ``trainer``: the whole ``Trainer.train_step()`` (data loader, guard, clipping, schedule, metrics);
- ``torchtitan``: torchtitan's Llama 3 model (fused wqkv, complex RoPE) with its ``ChunkedLossWrapper``
  (8 chunks), SDPA causal attention as tessera's (its LM default, flex attention, is a CUDA kernel);
- ``hf``: HF transformers' ``LlamaForCausalLM`` (sdpa), full logits;
- ``litgpt``: LitGPT's ``GPT`` (LLaMAMLP, RMSNorm), full logits.

A peer that is not installed is skipped with one line (``pip install -e .[peers]`` brings them all).
Rounds interleave the contenders (each times ``--steps`` steps per round after a warm-up), at every
dtype x threads setting asked for, so machine noise hits all alike; ``--clock cpu`` times the
process's CPU time (a machine shared with other work). Printed: a markdown table of median tokens/s
and spread (min..max) per contender, and each one's ratio to ``--base`` (torchtitan); ``--compile``
compiles every block of the contenders that have blocks (regional compilation) and prints the first
step's seconds; ``--profile`` prints the top-10 ops of one step of ``--profile-of`` contenders.

    python benchmarks/peers.py                                   # issue shape: dim 512, 8 layers, GQA 8/4
    python benchmarks/peers.py --shape 125m --dtypes fp32 --threads 2
    python benchmarks/peers.py --shape small --contenders tessera,torchtitan --profile
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from throughput import _tessera_overrides as tessera_overrides  # the same shape keys (benchmarks/ is on the path)

Step = Callable[[], None]
Builder = Callable[[argparse.Namespace, Path], "Contender"]

SHAPES = {  # dim, layers, heads, kv heads, ffn, vocab, seq, batch
    "small": (256, 4, 8, 4, 704, 8192, 256, 4),
    "issue": (512, 8, 8, 4, 1408, 8192, 512, 8),
    "125m": (768, 12, 12, 4, 2048, 32768, 512, 4),
}
PEER_MODULES = {"torchtitan": "torchtitan", "hf": "transformers", "litgpt": "litgpt"}


class Contender:
    """A model and its step: ``step()`` trains one batch; ``blocks`` are what ``--compile`` compiles."""

    def __init__(self, model: torch.nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor], args, blocks=None):
        self.model, self.loss_of, self.dtype, self.blocks = model, loss_of, args.dtype, blocks
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.batches = _batches(args)
        self.i = 0

    def step(self) -> None:
        """One optimizer step: forward and loss under autocast (bf16) or not, backward, clip, AdamW."""
        self.i += 1
        batch = self.batches[self.i % len(self.batches)]
        with _autocast(self.dtype):
            loss = self.loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Callback:
    """A contender that is a bare callable (the Trainer's step)."""

    def __init__(self, step: Step, model: torch.nn.Module | None = None) -> None:
        self.step, self.model, self.blocks, self.dtype = step, model, None, None


def _batches(args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(2)]


def _autocast(dtype: str | None) -> contextlib.AbstractContextManager:
    if dtype != "bf16":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _full_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _tessera_model(args: argparse.Namespace) -> torch.nn.Module:
    from tessera.model import build_model
    from tessera.validate import load_config

    torch.manual_seed(0)
    return build_model(load_config(None, tessera_overrides(args)).model)


def tessera_fused(args: argparse.Namespace, workdir: Path) -> Contender:
    """tessera's model with the fused chunked head + loss (what ``tessera train`` runs)."""
    from tessera.train.loss import FusedHeadLoss

    model = _tessera_model(args)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        return model(batch[:, :-1], output_fn=FusedHeadLoss(batch[:, 1:], None))

    return Contender(model, loss_of, args, model.layers)


def tessera_full(args: argparse.Namespace, workdir: Path) -> Contender:
    """tessera's model, full logits into cross-entropy."""
    model = _tessera_model(args)
    return Contender(model, lambda b: _full_ce(model(b[:, :-1]), b[:, 1:]), args, model.layers)


def tessera_trainer(args: argparse.Namespace, workdir: Path) -> Callback:
    """The whole ``Trainer.train_step()`` (throughput.py's contender of the same name)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from throughput import tessera_trainer as build  # a sibling script, not a package

    settings = {**vars(args), "threads": 1, "compile": "true" if args.compile else "false"}
    shape = argparse.Namespace(**settings, fused=True, adamw="fused", device="cpu")
    return Callback(build(shape, workdir))


def _torchtitan_model(args: argparse.Namespace) -> torch.nn.Module:
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.model import Llama3Model

    # Its language-model attention is flex (CUDA) or varlen; SDPA causal is the kernel tessera runs here.
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    rope = ComplexRoPE.Config(dim=args.dim // args.heads, max_seq_len=args.seq, theta=500000, scaling="none")
    layers = llama3._build_llama3_layers(
        fuse_qkv=True, n_layers=args.layers, dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
        hidden_dim=args.ffn, rope=rope, attn_backend="sdpa",
    )  # fmt: skip
    cfg = Llama3Model.Config(
        dim=args.dim,
        vocab_size=args.vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=args.vocab, embedding_dim=args.dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=args.dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=args.dim, out_features=args.vocab, param_init=llama3._output_linear_init(args.dim)
        ),
        layers=layers,
    )
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model


def torchtitan(args: argparse.Namespace, workdir: Path) -> Contender:
    """torchtitan's Llama 3 model with its chunked loss (``ChunkedLossWrapper``, 8 chunks), as its trainer runs it."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    model = _torchtitan_model(args)
    loss_cfg = ChunkedLossWrapper.Config(num_chunks=8, loss_fn=CrossEntropyLoss.Config(global_vocab_size=args.vocab))
    loss_fn = loss_cfg.build()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    tokens = torch.tensor(float(args.batch * args.seq))

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(batch[:, :-1]), batch[:, 1:], tokens)[0]

    return Contender(model, loss_of, args, model.layers)


def hf(args: argparse.Namespace, workdir: Path) -> Contender:
    """HF transformers' LlamaForCausalLM (sdpa), full logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    return Contender(model, lambda b: _full_ce(model(input_ids=b[:, :-1]).logits, b[:, 1:]), args, model.model.layers)


def litgpt(args: argparse.Namespace, workdir: Path) -> Contender:
    """LitGPT's GPT as a Llama (LLaMAMLP, RMSNorm, GQA), full logits."""
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(0)
    cfg = Config(
        block_size=args.seq, n_layer=args.layers, n_embd=args.dim, n_head=args.heads, n_query_groups=args.kv_heads,
        intermediate_size=args.ffn, vocab_size=args.vocab, padded_vocab_size=args.vocab, bias=False,
        norm_class_name="RMSNorm", norm_eps=1e-5, mlp_class_name="LLaMAMLP", parallel_residual=False,
        rotary_percentage=1.0,
    )  # fmt: skip
    model = GPT(cfg)
    return Contender(model, lambda b: _full_ce(model(b[:, :-1]), b[:, 1:]), args, model.transformer.h)


CONTENDERS: dict[str, Builder] = {
    "tessera": tessera_fused,
    "tessera-full": tessera_full,
    "trainer": tessera_trainer,
    "torchtitan": torchtitan,
    "hf": hf,
    "litgpt": litgpt,
}


def available(names: list[str]) -> list[str]:
    """The contenders whose package is installed; one line for each one skipped."""
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender {', '.join(unknown)}; pick from {', '.join(CONTENDERS)}")
    kept = []
    for name in names:
        module = PEER_MODULES.get(name)
        if module and importlib.util.find_spec(module) is None:
            print(f"skipped {name}: {module} is not installed (pip install -e .[peers])")
            continue
        kept.append(name)
    return kept


def compile_blocks(blocks) -> None:
    """Regional compilation: ``torch.compile`` each block in place (one graph reused by all blocks)."""
    if blocks is None:
        return
    for block in blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks:
        block.compile()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(step: Step, n: int, clock: str) -> float:
    now = CLOCKS[clock]
    start = now()
    for _ in range(n):
        step()
    return now() - start


def measure(contenders: dict[str, Contender], args: argparse.Namespace, threads: int) -> dict[str, list[float]]:
    """Tokens/s of each contender per round; the rounds interleave the contenders."""
    torch.set_num_threads(threads)
    for c in contenders.values():
        _time(c.step, args.warmup, args.clock)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    tokens = args.steps * args.batch * args.seq
    for _ in range(args.rounds):
        for name, c in contenders.items():
            rates[name].append(tokens / _time(c.step, args.steps, args.clock))
    return rates


def build(names: list[str], args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Contender], dict[str, float]]:
    """The contenders of one dtype (compiled with ``--compile``) and the seconds of each one's first step."""
    made, first = {}, {}
    for name in names:
        made[name] = CONTENDERS[name](args, workdir / f"{name}-{args.dtype}")
        if args.compile and name != "trainer":
            compile_blocks(made[name].blocks)
        first[name] = _time(made[name].step, 1, "wall")
    return made, first


def top_ops(step: Step, n: int = 10) -> list[tuple[str, float, int]]:
    """(op, self CPU ms, calls) of the ``n`` ops with the most self time in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ranked = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in ranked]


def print_profiles(contenders: dict[str, Contender], names: list[str], label: str) -> None:
    """The top-10 ops of one step of each of ``names``, and the step's matmul calls."""
    for name in names:
        if name not in contenders:
            continue
        ops = top_ops(contenders[name].step, 10)
        print(f"\ntop-10 ops by self CPU time, one step of {name} ({label}):")
        print("| op | self ms | calls |\n|---|---:|---:|")
        for key, ms, calls in ops:
            print(f"| `{key}` | {ms:,.1f} | {calls} |")


def cell(rates: list[float]) -> str:
    """'median (min..max)' tokens/s."""
    return f"{statistics.median(rates):,.0f} ({min(rates):,.0f}..{max(rates):,.0f})"


def parse() -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="issue")
    p.add_argument("--contenders", default="tessera,torchtitan,hf,litgpt", help=f"any of {','.join(CONTENDERS)}")
    p.add_argument("--base", default="torchtitan", help="the contender the ratios divide by")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--compile", action="store_true", help="regional torch.compile of every contender's blocks")
    p.add_argument("--steps", type=int, default=1, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clock", choices=list(CLOCKS), default="cpu", help="cpu: process CPU time (a busy machine)")
    p.add_argument("--profile", action="store_true", help="print the top-10 ops of one step (1 thread)")
    p.add_argument("--profile-of", default="tessera,torchtitan")
    args = p.parse_args()
    args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab, args.seq, args.batch = SHAPES[args.shape]
    return args


def main() -> None:
    """Build the contenders per dtype, measure every threads setting, print the table and the profiles."""
    args = parse()
    names = available(args.contenders.split(","))
    mode = "compiled (per block)" if args.compile else "eager"
    print(
        f"torch={torch.__version__} shape={args.shape}: dim={args.dim} layers={args.layers} heads={args.heads}/"
        f"{args.kv_heads} ffn={args.ffn} vocab={args.vocab} seq={args.seq} batch={args.batch}; {mode}; "
        f"{args.rounds} rounds x {args.steps} steps, clock={args.clock}; fused AdamW for all"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            args.dtype = dtype
            made, first = build(names, args, Path(tmp))
            print(f"{dtype}: first step (s) " + ", ".join(f"{n} {s:.1f}" for n, s in first.items()), flush=True)
            for threads in [int(t) for t in args.threads.split(",")]:
                rates = measure(made, args, threads)
                rows.append((dtype, threads, rates))
                print(f"{dtype} / {threads}: " + ", ".join(f"{n} {cell(r)}" for n, r in rates.items()), flush=True)
            if args.profile:
                torch.set_num_threads(1)
                print_profiles(made, args.profile_of.split(","), f"{dtype}, 1 thread, {mode}")
            del made
    print_table(rows, names, args.base)


def print_table(rows, names: list[str], base: str) -> None:
    """The markdown table: tokens/s per contender and each one's ratio of medians to ``base``."""
    others = [n for n in names if n != base]
    head = ["dtype / threads", *(f"{n} tok/s" for n in names), *(f"{n} / {base}" for n in others if base in names)]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for dtype, threads, rates in rows:
        cells = [f"{dtype} / {threads}", *(cell(rates[n]) for n in names)]
        if base in rates:
            b = statistics.median(rates[base])
            cells += [f"{statistics.median(rates[n]) / b:.3f}" for n in others]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
