"""Peak memory of one training step at a large vocabulary: the fused chunked head + loss against
the plain loss on full logits and against HF transformers' LlamaForCausalLM.

Three contenders train the same Llama shape (random init, fp32, AdamW) on the same batch:

- ``fused``: tessera's model with ``output_fn=FusedHeadLoss`` (what ``tessera train`` runs by
  default): one chunk of logits at a time (``train.loss_chunk_tokens``, default 64 MiB of logits).
- ``plain``: tessera's model, full logits, ``lm_loss`` (``train.fused_loss=false``).
- ``hf``: ``LlamaForCausalLM(input_ids, labels=...)`` (full logits, its own cross-entropy).

torch's ``MemTracker`` adds up every live tensor's storage (CPU works as well as CUDA); the peak
of a step after an untracked warm-up step is printed in MiB, with the part above the model states
at rest (parameters, gradients, AdamW moments), which is where the logits live, and the step's
peak so far after its forward (with the loss), its backward and its optimizer step: the phase where
the peak first appears is the one that sets it. ``--fused-adamw`` gives every contender
``torch.optim.AdamW(fused=True)`` instead of torch's default.

    python benchmarks/memory_head.py                       # vocab 32k and 128k, dim 256, 2 layers, 1024 tokens
    python benchmarks/memory_head.py --vocabs 32768 --seq 1024 --batch 4
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch

MIB = 2**20


def _tessera(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    from tessera.config import model_config
    from tessera.model import build_model

    cfg = model_config(
        vocab_size=vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads // 2,
        ffn_hidden=args.ffn,
        max_seq_len=args.seq,
        norm_eps=1e-5,
        tie_embeddings=False,
    )
    return build_model(cfg)


def _hf(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def _loss_fn(name: str, chunk: int) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    from tessera.train.loss import FusedHeadLoss, lm_loss

    if name == "fused":
        return lambda m, b: m(b[:, :-1], output_fn=FusedHeadLoss(b[:, 1:], None, 0.0, chunk))
    if name == "plain":
        return lambda m, b: lm_loss(m(b[:, :-1]), b[:, 1:])
    # HF shifts the labels itself: inputs and labels are the same seq tokens (seq - 1 predictions)
    return lambda m, b: m(input_ids=b[:, :-1], labels=b[:, :-1]).loss


PHASES = ("forward", "backward", "optimizer")


def peak(name: str, args: argparse.Namespace, vocab: int) -> tuple[float, float, dict[str, float]]:
    """(peak MiB of one step, MiB of the model states at rest, the step's peak so far after each phase:
    forward with the loss, backward, optimizer step) for one contender."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = _hf(args, vocab) if name == "hf" else _tessera(args, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if args.fused_adamw else {}))
    loss_of = _loss_fn(name, args.chunk)
    batch = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def step(mark=lambda phase: None) -> None:
        loss = loss_of(model, batch)
        mark("forward")
        loss.backward()
        del loss
        mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")

    step()  # untracked warm-up: AdamW state exists from here on
    states = sum(p.numel() * p.element_size() for p in model.parameters())
    states += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    states += sum(p.numel() * p.element_size() for p in model.parameters())  # the gradients, at their peak
    tracker = MemTracker()
    tracker.track_external(model, opt)
    phases: dict[str, float] = {}

    def mark(phase: str) -> None:
        phases[phase] = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) / MIB

    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        step(mark)
    total = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    return total / MIB, states / MIB, phases


def main() -> None:
    """Parse the shape, measure each contender at each vocabulary, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="32768,131072")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0, help="train.loss_chunk_tokens of the fused loss (0 = default)")
    p.add_argument("--contenders", default="fused,plain,hf")
    p.add_argument("--fused-adamw", action="store_true", help="torch.optim.AdamW(fused=True) for every contender")
    args = p.parse_args()
    torch.set_num_threads(1)
    tokens = args.batch * args.seq
    print(
        f"torch={torch.__version__} fp32 dim={args.dim} layers={args.layers} ffn={args.ffn} "
        f"tokens/step={tokens} ({args.batch}x{args.seq}) chunk={args.chunk or 'default'}"
    )
    print(f"AdamW {'fused' if args.fused_adamw else 'default (for-loop on CPU)'}; peak so far after each phase")
    print(
        f"{'vocab':>7} {'contender':>9} {'peak MiB':>9} {'above states':>13} {'full fp32 logits MiB':>21} "
        + " ".join(f"{p:>10}" for p in PHASES)
    )
    for vocab in (int(v) for v in args.vocabs.split(",")):
        peaks = {}
        for name in args.contenders.split(","):
            peaks[name], states, phases = peak(name, args, vocab)
            logits = tokens * vocab * 4 / MIB
            print(
                f"{vocab:>7} {name:>9} {peaks[name]:>9.0f} {peaks[name] - states:>13.0f} {logits:>21.0f} "
                + " ".join(f"{phases[p]:>10.0f}" for p in PHASES)
            )
        for other in ("plain", "hf"):
            if "fused" in peaks and other in peaks:
                print(f"{vocab:>7} peak fused/{other} = {peaks['fused'] / peaks[other]:.3f}")


if __name__ == "__main__":
    main()
