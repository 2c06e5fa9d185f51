"""Perplexity at multiples of the training length (``tessera eval RUN --lengths 1x,2x,4x``).

The model is rebuilt from its own config with a longer context and, for RoPE, the scaling asked for
(``none``, ``linear`` (position interpolation), ``ntk``, ``yarn``, ``llama3``, or ``model``: as trained), the
scaling factor being the length over the training length; its weights are loaded unchanged (RoPE tables are
not weights). The text is the run's validation split (or an indexed dataset, ``--data PREFIX``): the same
leading tokens at every length, cut into consecutive windows, so each length scores the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.model import build_model

SCALINGS = ("model", "none", "linear", "ntk", "yarn", "llama3")
UNBOUNDED = ("rope", "alibi", "t5_bias", "none", "sinusoidal")  # position schemes that represent any length


@dataclass
class LengthRow:
    """Perplexity of one (length, RoPE scaling) pair."""

    length: int
    multiple: float
    scaling: str
    nll: float
    tokens: int

    @property
    def ppl(self) -> float:
        """exp(mean next-token NLL)."""
        return math.exp(min(self.nll, 50.0))


def parse_lengths(spec: str, base: int) -> list[int]:
    """``"1x,2x,4x"`` (multiples of ``base``) or token counts (``"128,512"``) as token counts."""
    lengths = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            value = float(part[:-1]) * base if part.endswith("x") else float(part)
        except ValueError:
            raise ConfigError(f"--lengths: {part!r} is neither a multiple (2x) nor a token count (512)") from None
        if value < 2 or value != int(value):
            raise ConfigError(f"--lengths: {part!r} gives {value:g} tokens; give a whole number of at least 2")
        lengths.append(int(value))
    if not lengths:
        raise ConfigError("--lengths is empty; give e.g. 1x,2x,4x")
    return lengths


def parse_scalings(spec: str, cfg: ModelConfig) -> list[str]:
    """The RoPE scalings to compare (``model`` keeps the trained one); only ``model`` without RoPE."""
    names = [s.strip() for s in spec.split(",") if s.strip()] or ["model"]
    for name in names:
        if name not in SCALINGS:
            raise ConfigError(f"--rope-scaling {name!r} is not one of {', '.join(SCALINGS)}")
        if name != "model" and cfg.position.kind != "rope":
            raise ConfigError(
                f"--rope-scaling {name} needs RoPE; this model's positions are {cfg.position.kind!r}: use model"
            )
    return names


def check_length(cfg: ModelConfig, length: int) -> None:
    """ConfigError when the model's position scheme cannot represent ``length`` tokens (a learned table)."""
    if cfg.position.kind not in UNBOUNDED and length > cfg.max_seq_len:
        raise ConfigError(
            f"--lengths: {length} tokens is beyond what {cfg.position.kind} positions represent "
            f"(model.max_seq_len={cfg.max_seq_len} trained entries); give lengths up to {cfg.max_seq_len}"
        )


def scaled_config(cfg: ModelConfig, length: int, base: int, scaling: str) -> ModelConfig:
    """``cfg`` with room for ``length`` tokens and, unless ``scaling`` is "model", that RoPE scaling."""
    max_len = max(cfg.max_seq_len, length)
    pos = cfg.position
    if scaling != "model":
        factor = max(length / base, 1.0)
        pos = dataclasses.replace(
            pos, rope_scaling=scaling, rope_scaling_factor=factor, rope_original_max_len=base if factor > 1 else 0
        )
    return dataclasses.replace(cfg, max_seq_len=max_len, position=pos)


def rebuilt(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """A model of ``cfg`` holding ``model``'s weights (tables such as RoPE's are recomputed)."""
    if cfg == model.cfg:
        return model
    other = build_model(cfg)
    other.load_state_dict(model.state_dict())
    return other.eval()


@torch.no_grad()
def window_nll(model: nn.Module, stream: np.ndarray, length: int, budget: int) -> tuple[float, int]:
    """Mean next-token NLL over consecutive windows of ``length`` tokens from the first ``budget`` tokens."""
    n = max(1, min(budget, len(stream) - 1) // length)
    if n * length + 1 > len(stream):
        raise ConfigError(f"--lengths: {length} tokens is longer than the evaluation text ({len(stream)} tokens)")
    tokens = torch.from_numpy(stream[: n * length + 1].astype(np.int64))
    total = 0.0
    for i in range(n):
        window = tokens[i * length : (i + 1) * length + 1]
        logits = model(window[None, :-1])[0].float()
        total += float(F.cross_entropy(logits, window[1:], reduction="sum").double())
    return total / (n * length), n * length


def length_table(
    model: nn.Module, stream: np.ndarray, base: int, lengths: list[int], scalings: list[str], budget: int
) -> list[LengthRow]:
    """Perplexity for every (scaling, length), each length checked against the position scheme first."""
    for length in lengths:
        check_length(model.cfg, length)
    rows = []
    for scaling in scalings:
        for length in lengths:
            variant = rebuilt(model, scaled_config(model.cfg, length, base, scaling))
            nll, count = window_nll(variant, stream, length, budget)
            rows.append(LengthRow(length, length / base, scaling, nll, count))
    return rows


def format_table(rows: list[LengthRow], title: str) -> str:
    """A Markdown table: one row per scaling, one column per length."""
    lengths = sorted({r.length for r in rows})
    scalings = list(dict.fromkeys(r.scaling for r in rows))
    by = {(r.scaling, r.length): r for r in rows}
    head = "| " + title + " | " + " | ".join(f"{by[(scalings[0], n)].multiple:g}x ({n})" for n in lengths) + " |"
    lines = [head, "|" + "---|" * (len(lengths) + 1)]
    for s in scalings:
        lines.append(f"| {s} | " + " | ".join(f"{by[(s, n)].ppl:.2f}" for n in lengths) + " |")
    return "\n".join(lines)


def plot_lengths(rows: list[LengthRow], title: str, out: Path) -> Path:
    """Perplexity against length (log scale), one line per scaling, into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for s in dict.fromkeys(r.scaling for r in rows):
        points = sorted((r.length, r.ppl) for r in rows if r.scaling == s)
        ax.plot(*zip(*points), "o-", label=f"rope scaling: {s}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
