"""Generation: cache bytes per token, int8-cache quality, tokens/s by cache kind and with a draft, and HF.

    python benchmarks/generate.py --target runs/smoke --draft runs/student_plain60
    python benchmarks/generate.py --target runs/smoke --draft runs/student_plain60 --rounds 1 --new-tokens 32  # quicker

The target is a trained tessera run (the smoke model); the draft a smaller decoder trained on the same
data with the same tokenizer (e.g. the smoke recipe with ``model.n_layers=2``). In one run it reports:

- cache bytes per token of context for fp32, bf16 and int8 caches (and the ratios to bf16 and fp32);
- validation perplexity read through each cache one token at a time (teacher forcing), and its
  relative change from the fp32 cache;
- greedy continuations of 20 validation prompts through the int8 and bf16 caches: how many differ
  from the fp32 cache's, and where the first difference is;
- tokens/s of greedy decoding (batch 1) with each cache, with the draft (speculative decoding,
  acceptance rate), and HF ``generate`` on the exported model (same prompts, greedy, its KV cache):
  rounds alternate between the contenders so machine noise hits all alike; median and spread
  (max/min) over rounds; ``ratio`` = tokens/s over HF's. HF's greedy tokens are compared with
  tessera's first (they must match).

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from tessera.api import find_checkpoint, load, load_draft
from tessera.validate import load_config
from tessera.data.pipeline import build_data
from tessera.model import generate
from tessera.model.cache import cache_footprint
from tessera.model.generate import cached_nll
from tessera.model.speculative import SpeculativeStats, speculative_generate

KINDS = ("fp32", "bf16", "int8")


def validation_windows(run: str, count: int) -> torch.Tensor:
    """``count`` validation windows (count, seq_len + 1) of the run's own data split."""
    ckpt = find_checkpoint(run)
    config = load_config(ckpt.parent.parent / "config.toml", ["train.resume=none"])
    val = build_data(config).val
    step = max(len(val) // count, 1)
    return torch.stack([torch.as_tensor(val[i * step], dtype=torch.long) for i in range(count)])


def report_bytes(model: torch.nn.Module) -> None:
    """Bytes per token of context by cache kind."""
    sizes = {kind: cache_footprint(model, kind)[0] for kind in KINDS}
    print("\ncache bytes per token of context (one sequence, all layers, keys + values [+ int8 scales])")
    for kind, size in sizes.items():
        print(f"  {kind:5s} {size:7,d} B   {size / sizes['bf16']:.3f} x bf16   {size / sizes['fp32']:.3f} x fp32")


def report_quality(model: torch.nn.Module, windows: torch.Tensor, prompt_len: int, new_tokens: int) -> None:
    """Perplexity through each cache, and how many greedy continuations differ from the fp32 cache's."""
    print(f"\nvalidation perplexity through the cache ({windows.shape[0]} windows of {windows.shape[1]} tokens)")
    nll = {kind: cached_nll(model, windows, kind) for kind in KINDS}
    for kind, value in nll.items():
        change = math.exp(value - nll["fp32"]) - 1
        print(f"  {kind:5s} ppl {math.exp(value):9.4f}   {change:+.4%} vs fp32")
    prompts = windows[:20, :prompt_len]
    reference = generate(model, prompts, new_tokens, temperature=0.0, kv_cache="fp32")
    print(f"greedy continuations of {prompts.shape[0]} prompts ({prompt_len} tokens, {new_tokens} new)")
    for kind in KINDS[1:]:
        out = generate(model, prompts, new_tokens, temperature=0.0, kv_cache=kind)
        differ = (out != reference).any(dim=1)
        firsts = [int((row != ref).nonzero()[0]) for row, ref, d in zip(out, reference, differ) if d]
        print(f"  {kind:5s} {int(differ.sum())}/{prompts.shape[0]} differ from fp32 (first difference at {firsts})")


def _timed(fn: Callable[[], int]) -> float:
    started = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - started)


def _hf_model(run: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tessera.hf.convert import hf_export

    out = tempfile.mkdtemp(prefix="tessera_hf_")
    hf_export(run, out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def contenders(args: argparse.Namespace, model: torch.nn.Module, prompts: torch.Tensor) -> dict[str, Callable]:
    """name -> a function decoding every prompt (batch 1) and returning the tokens made."""
    n = args.new_tokens
    stats = SpeculativeStats()

    def tessera(kind: str) -> Callable[[], int]:
        return lambda: sum(generate(model, p[None], n, temperature=0.0, kv_cache=kind).shape[1] for p in prompts)

    def speculative(kind: str) -> int:
        made = 0
        for p in prompts:
            out, s = speculative_generate(model, draft, p[None], n, args.draft_tokens, kv_cache=kind)
            made += out.shape[1]
            stats.rounds, stats.proposed, stats.accepted = (
                stats.rounds + s.rounds,
                stats.proposed + s.proposed,
                stats.accepted + s.accepted,
            )
        return made

    runs: dict[str, Callable[[], int]] = {f"tessera {kind}": tessera(kind) for kind in KINDS}
    if args.draft:
        draft = load_draft(args.draft, model)
        for kind in ("fp32", "int8"):
            runs[f"tessera {kind} + draft k={args.draft_tokens}"] = lambda kind=kind: speculative(kind)
    runs["_stats"] = stats  # type: ignore[assignment]
    if not args.no_hf:
        hf = _hf_model(args.target)
        runs["HF generate"] = lambda: sum(_hf_generate(hf, p, n).shape[0] for p in prompts)
        check_hf_matches(model, hf, prompts[:4], n)
    return runs


@torch.no_grad()
def _hf_generate(hf: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    out = hf.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)
    return out[0, prompt.shape[0] :]


def check_hf_matches(model: torch.nn.Module, hf: torch.nn.Module, prompts: torch.Tensor, n: int) -> None:
    """Greedy tokens of HF on the exported model against tessera's (fp32 cache)."""
    same = sum(
        torch.equal(_hf_generate(hf, p, n), generate(model, p[None], n, temperature=0.0, kv_cache="fp32")[0])
        for p in prompts
    )
    print(f"\nHF greedy tokens equal tessera's on {same}/{prompts.shape[0]} prompts")


def report_speed(args: argparse.Namespace, model: torch.nn.Module, windows: torch.Tensor) -> None:
    """Interleaved rounds of every contender; median tokens/s, spread, ratio to HF."""
    prompts = windows[: args.prompts, : args.prompt_len]
    runs = contenders(args, model, prompts)
    stats = runs.pop("_stats")
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            speeds[name].append(_timed(fn))
    hf = statistics.median(speeds["HF generate"]) if "HF generate" in speeds else None
    print(
        f"\ngreedy decoding, batch 1, {len(prompts)} prompts x {args.new_tokens} new tokens, {args.rounds} rounds, "
        f"{torch.get_num_threads()} thread(s)"
    )
    for name, values in speeds.items():
        median = statistics.median(values)
        ratio = f"ratio={median / hf:.2f}" if hf else ""
        print(f"  {name:28s} {median:8.1f} tokens/s  spread {max(values) / min(values):.2f}  {ratio}")
    if stats.proposed:
        print(
            f"draft acceptance: {stats.accepted}/{stats.proposed} = {stats.acceptance_rate:.1%}, "
            f"{stats.tokens_per_round:.2f} tokens per target forward"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="runs/smoke")
    parser.add_argument("--draft", default="", help="a smaller run on the same data ('' = no draft; 'mtp')")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--windows", type=int, default=32, help="validation windows for perplexity")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per speed round")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load(args.target).eval()
    windows = validation_windows(args.target, max(args.windows, 20))
    report_bytes(model)
    report_quality(model, windows, args.prompt_len, args.new_tokens)
    report_speed(args, model, windows)


if __name__ == "__main__":
    main()
