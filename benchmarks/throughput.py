"""Training-step throughput: tessera's full Trainer step against a bare loop and against HF transformers.

The contenders train the same Llama shape (random init, AdamW, gradient clipping at 1.0):

- ``trainer``: ``tessera.train.Trainer.train_step()`` as ``tessera train`` runs it: its data
  loader (prefetching), objective, fused chunked head + loss, the one host read per step, the
  non-finite guard, clipping, LR schedule.
- ``bare``: the same tessera model in a hand-written loop (``model(x)``, ``F.cross_entropy`` on
  the full logits, backward, clip, fused AdamW) on pre-made batches: the floor any trainer adds to.
- ``hf``: HF transformers' ``LlamaForCausalLM`` in the same hand-written loop.
- ``hf-trainer``: ``transformers.Trainer``'s inner step (``training_step`` then the clip,
  optimizer and scheduler steps its ``train()`` loop runs), on pre-made batches. Its default
  optimizer is torch's fused AdamW, as tessera's (``optim.implementation=auto``) and the bare loops'.
- ``trainer-compiled`` (``parallel.compile=true``) and ``trainer-alt`` (the ``--alt`` overrides):
  before/after pairs for the ``trainer`` (e.g. ``--alt optim.implementation=for-loop``); the first
  step of each is printed too, and for ``trainer-compiled`` the steps after which compiling pays.

Rounds interleave the contenders (each times ``--steps`` steps per round, after a warm-up) so
machine noise hits all alike (``--clock cpu`` times process CPU time instead of wall time, for a
machine shared with other work). Printed per contender: median tokens/s over rounds and the spread
(min..max); then ratios of medians. Threads are stated (``--threads``, default 1).

    python benchmarks/throughput.py                      # dim 256, 4 layers, seq 256, batch 4, vocab 32k
    python benchmarks/throughput.py --vocab 8192 --dtype bf16 --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

Step = Callable[[], None]


def _tessera_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"model.vocab_size={args.vocab}",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.heads}",
        f"model.n_kv_heads={args.kv_heads}",
        f"model.ffn_hidden={args.ffn}",
        f"model.max_seq_len={args.seq}",
        "model.norm_eps=1e-5",
        f"train.seq_len={args.seq}",
        "model.tie_embeddings=false",
    ]


def _batches(args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    made = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)]
    return [b.to(args.device) for b in made]


def _cycle(batches: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    state = {"i": 0}

    def next_batch() -> torch.Tensor:
        state["i"] += 1
        return batches[state["i"] % len(batches)]

    return next_batch


def _autocast(dtype: str, device: str) -> contextlib.AbstractContextManager:
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def tessera_trainer(args: argparse.Namespace, workdir: Path, extra: tuple[str, ...] = ()) -> Step:
    """The full Trainer step (real data loader over the stdlib corpus, tokenizer of 512 tokens)."""
    from tessera.validate import load_config
    from tessera.data.pipeline import build_data
    from tessera.train.trainer import Trainer

    data = ["data.max_chars=400000", "data.tokenizer_chars=400000", f"data.cache_dir={workdir / 'cache'}"]
    small = load_config(None, [*data, "model.vocab_size=512", f"train.run_dir={workdir / 'tok'}"])
    tokenizer = build_data(small).tokenizer.path  # ids < 512 cost the same as any: only the vocab size matters
    overrides = (
        _tessera_overrides(args)
        + data
        + [
            f"data.tokenizer={tokenizer}",
            f"train.seq_len={args.seq}",
            f"train.batch_size={args.batch}",
            "train.steps=100000",
            "train.eval_every=0",
            "train.sample_tokens=0",
            f"train.dtype={args.dtype}",
            f"train.threads={args.threads}",
            f"train.device={args.device}",
            "optim.lr=1e-4",
            "optim.grad_clip=1.0",
            "checkpoint.enabled=false",
            "log.progress=none",
            "log.tensorboard=false",
            "log.plot=false",
            "log.peak_flops=1e12",
            f"train.run_dir={workdir / 'run'}",
        ]
    )
    if not args.fused:
        overrides.append("train.fused_loss=false")
    overrides += [f"optim.implementation={args.adamw}", f"parallel.compile={args.compile}", *extra]
    trainer = Trainer(load_config(None, overrides))
    return trainer.train_step


def _loop(model: torch.nn.Module, batches: list[torch.Tensor], dtype: str, logits_of) -> Step:
    device = batches[0].device.type
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the kernel of tessera (auto) and HF Trainer
    next_batch = _cycle(batches)

    def step() -> None:
        batch = next_batch()
        with _autocast(dtype, device):
            logits = logits_of(model, batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def tessera_bare(args: argparse.Namespace, workdir: Path) -> Step:
    """tessera's model in a hand-written loop."""
    from tessera.validate import load_config
    from tessera.model import build_model

    torch.manual_seed(0)
    cfg = load_config(None, _tessera_overrides(args)).model
    return _loop(build_model(cfg), _batches(args), args.dtype, lambda m, x: m(x))


def _hf_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def hf_bare(args: argparse.Namespace, workdir: Path) -> Step:
    """HF LlamaForCausalLM in the same hand-written loop."""
    return _loop(_hf_model(args), _batches(args), args.dtype, lambda m, x: m(input_ids=x).logits)


def hf_trainer(args: argparse.Namespace, workdir: Path) -> Step:
    """transformers.Trainer's inner step: ``training_step`` + clip + optimizer + scheduler (its ``train()`` loop)."""
    from transformers import Trainer, TrainingArguments

    model = _hf_model(args)
    targs = TrainingArguments(
        output_dir=str(workdir / "hf"),
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        bf16=args.dtype == "bf16",
        use_cpu=args.device == "cpu",
        report_to=[],
        save_strategy="no",
    )
    trainer = Trainer(model=model, args=targs)
    trainer.create_optimizer_and_scheduler(num_training_steps=100000)
    trainer.current_gradient_accumulation_steps = 1  # set by its train() loop
    model.train()
    next_batch = _cycle(_batches(args))

    def step() -> None:
        batch = next_batch()
        inputs = {"input_ids": batch[:, :-1], "labels": batch[:, :-1]}  # HF shifts the labels itself
        trainer.training_step(model, inputs)
        trainer.accelerator.clip_grad_norm_(model.parameters(), targs.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad(set_to_none=True)

    return step


def tessera_trainer_compiled(args: argparse.Namespace, workdir: Path) -> Step:
    """The Trainer step with every block compiled (``parallel.compile=true``)."""
    return tessera_trainer(args, workdir, ("parallel.compile=true",))


def tessera_trainer_alt(args: argparse.Namespace, workdir: Path) -> Step:
    """The Trainer step with the ``--alt`` overrides (e.g. optim.implementation=for-loop): a before/after pair."""
    return tessera_trainer(args, workdir, tuple(args.alt))


CONTENDERS = {
    "trainer": tessera_trainer,
    "bare": tessera_bare,
    "hf": hf_bare,
    "hf-trainer": hf_trainer,
    "trainer-compiled": tessera_trainer_compiled,
    "trainer-alt": tessera_trainer_alt,
}
DEFAULT_CONTENDERS = "trainer,bare,hf,hf-trainer"


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(step: Step, n: int, clock: str = "wall") -> float:
    """Seconds of ``n`` steps on ``clock``: wall, or this process's CPU time (all its threads), which a
    machine shared with other work disturbs far less."""
    now = CLOCKS[clock]
    start = now()
    for _ in range(n):
        step()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return now() - start


def measure(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Tokens/s of each contender in each round (rounds interleave the contenders), and the seconds
    of each one's first step (kernels, allocator, optimizer state; compilation with torch.compile)."""
    names = args.contenders.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        steps = {name: CONTENDERS[name](args, Path(tmp) / name) for name in names}
        torch.set_num_threads(args.threads)  # after the builders: the Trainer applies train.threads itself
        first = {name: _time(steps[name], 1, args.clock) for name in names}
        for name in names:  # warm up the rest
            _time(steps[name], args.warmup)
        rates: dict[str, list[float]] = {name: [] for name in names}
        tokens = args.steps * args.batch * args.seq
        for _ in range(args.rounds):
            for name in names:
                rates[name].append(tokens / _time(steps[name], args.steps, args.clock))
    return rates, first


def shape_parser(description: str) -> argparse.ArgumentParser:
    """The model shape, batch, precision, threads and the Trainer's switches (shared with profile_step.py)."""
    p = argparse.ArgumentParser(description=description)
    for flag, default in [("dim", 256), ("layers", 4), ("heads", 8), ("kv-heads", 4), ("ffn", 704)]:
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--no-fused", dest="fused", action="store_false", help="the trainer with train.fused_loss=false")
    p.add_argument("--adamw", default="auto", help="optim.implementation of the Trainer (auto|fused|foreach|for-loop)")
    p.add_argument("--compile", default="auto", help="parallel.compile of the Trainer (auto|true|false)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (every contender)")
    return p


def main() -> None:
    """Parse the shape, measure, print tokens/s (median and spread) and the ratios of medians."""
    p = shape_parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"any of {','.join(CONTENDERS)}")
    p.add_argument("--alt", nargs="*", default=[], help="config overrides of the trainer-alt contender")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall", help="cpu: process CPU time (a busy machine)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="print MFU against this peak (H200 bf16: 989)")
    args = p.parse_args()
    print(
        f"threads={args.threads} torch={torch.__version__} {args.device} dtype={args.dtype} dim={args.dim} "
        f"layers={args.layers} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} seq={args.seq} "
        f"batch={args.batch} rounds={args.rounds}x{args.steps} steps clock={args.clock} fused_loss={args.fused} "
        f"adamw={args.adamw} compile={args.compile}"
        + (f" trainer-alt: {' '.join(args.alt)}" if "trainer-alt" in args.contenders else "")
    )
    rates, first = measure(args)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        step_s = args.batch * args.seq / medians[name]
        print(
            f"{name:>16}: {medians[name]:8,.0f} tok/s median  (min {min(r):,.0f} .. max {max(r):,.0f})  "
            f"step {step_s:.3f} s, first step {first[name]:.1f} s"
        )
    pairs = [("trainer", "bare"), ("trainer", "hf-trainer"), ("bare", "hf"), ("trainer", "hf")]
    for a, b in [*pairs, ("trainer-compiled", "trainer"), ("trainer-alt", "trainer")]:
        if a in medians and b in medians:
            print(f"ratio {a}/{b} = {medians[a] / medians[b]:.3f}")
    if "trainer-compiled" in medians and "trainer" in medians:
        _print_break_even(args.batch * args.seq, medians, first)
    if args.peak_tflops:
        _print_mfu(args, medians)


def _print_mfu(args: argparse.Namespace, medians: dict[str, float]) -> None:
    """Model FLOPs utilization of each contender: tokens/s x training FLOPs per token (as ``tessera train``
    counts them: tessera/train/flop_count.py, the modules that run) over ``--peak-tflops``."""
    from tessera.validate import load_config
    from tessera.model import build_model, count_parameters
    from tessera.train.flops import flops_per_token

    cfg = load_config(None, _tessera_overrides(args)).model
    with torch.device("meta"):
        model = build_model(cfg)
    matmul = count_parameters(model, exclude_embeddings=True)
    per_token = flops_per_token(cfg, args.seq)
    print(
        f"{count_parameters(model) / 1e9:.2f}B parameters ({matmul / 1e9:.2f}B in matmuls), {per_token:.3g} FLOP/token"
    )
    for name, rate in medians.items():
        print(f"MFU {name}: {rate * per_token / (args.peak_tflops * 1e12):.1%} of {args.peak_tflops:g} TFLOP/s")


def _print_break_even(tokens: int, medians: dict[str, float], first: dict[str, float]) -> None:
    """Compile seconds (the compiled first step's extra over the eager first step) against the seconds
    each compiled step saves: how many steps a run needs before compiling pays."""
    compile_s = first["trainer-compiled"] - first["trainer"]
    saved = tokens / medians["trainer"] - tokens / medians["trainer-compiled"]
    steps = f"{compile_s / saved:,.0f} steps" if saved > 0 else "never (compiled steps are not faster)"
    print(f"compile: {compile_s:.1f} s extra on the first step; saves {saved:.3f} s/step; break-even after {steps}")


if __name__ == "__main__":
    main()
