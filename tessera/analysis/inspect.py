"""``tessera inspect attention``: heatmaps and per-head statistics of a model's attention on a text.

The maps are recorded through :func:`tessera.analysis.capture.observe_attention` (an exact eager
pass, whatever kernel trained the model) for the prompt and, with ``generate``, for each greedy
decoding step, whose rows are appended below the prompt's. Attention maps show where a head looks,
not why: a starting point for debugging, not proof of what a head does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tessera.analysis.capture import (
    is_cross,
    layer_index,
    layer_label,
    layer_stem,
    observe_attention,
)
from tessera.analysis.plot import display_tokens, draw_layer
from tessera.analysis.stats import HeadStats, format_table, head_stats
from tessera.analysis.text import Codec, load_codec
from tessera.config import ConfigError
from tessera.model.attention import kernel_spec

CAVEAT = "attention maps show where a head looks, not why: a starting point for debugging, not proof"


@dataclass
class Recording:
    """Each attention module's weight rows (batch row 0) from every forward, in order; nothing on the model."""

    chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __call__(self, name: str, weights: torch.Tensor) -> None:
        self.chunks.setdefault(name, []).append(weights[0].detach().float().cpu())

    def maps(self) -> dict[str, torch.Tensor]:
        """(H, Tq, Tk) per module: the rows of all forwards stacked, keys padded to the longest."""
        out = {}
        for name, chunks in self.chunks.items():
            tk = max(c.shape[-1] for c in chunks)
            out[name] = torch.cat([F.pad(c, (0, tk - c.shape[-1])) for c in chunks], dim=1)
        return out


@dataclass
class Tokens:
    """Token strings of the streams a model attends over: its input and (encoder-decoder) decoder inputs."""

    source: list[str]
    target: list[str]
    prompt_rows: int  # rows before the first generated token
    generated: str = ""


@torch.no_grad()
def record_decoder(model: nn.Module, ids: list[int], steps: int, recording: Recording) -> list[int]:
    """Prompt, then ``steps`` greedy tokens with a KV cache, each fed back so its map row is recorded."""
    total = len(ids) + steps
    caches = model.new_caches(1, total)
    generated: list[int] = []
    with observe_attention(model, recording):
        logits = model(torch.tensor([ids]), caches, start=0)[:, -1]
        for pos in range(len(ids), total):
            generated.append(int(logits.argmax(-1)))
            logits = model(torch.tensor([[generated[-1]]]), caches, start=pos)[:, -1]
    return generated


@torch.no_grad()
def record_seq2seq(
    model: nn.Module, ids: list[int], steps: int, recording: Recording, start_id: int = 0
) -> tuple[list[int], list[int]]:
    """The encoder on ``ids``, then ``steps`` greedy decoder steps from ``start_id``: (decoder inputs, outputs)."""
    inputs: list[int] = []
    generated: list[int] = []
    with observe_attention(model, recording):
        memory = model.encode(torch.tensor([ids]))
        caches = model.new_caches(1, max(steps, 1))
        token = start_id
        for pos in range(steps):
            inputs.append(token)
            token = int(model.decode(torch.tensor([[token]]), memory, caches, start=pos)[:, -1].argmax(-1))
            generated.append(token)
    return inputs, generated


def record(model: nn.Module, codec: Codec, text: str, steps: int) -> tuple[dict[str, torch.Tensor], Tokens]:
    """Run ``model`` on ``text`` (and ``steps`` generated tokens) and return every module's maps and tokens."""
    arch = model.cfg.arch
    ids = codec.encode(text)
    if not ids:
        raise ConfigError("--text encodes to no tokens; give some text")
    limit = model.cfg.max_seq_len
    if len(ids) + (steps if arch == "decoder" else 0) > limit:
        raise ConfigError(f"--text ({len(ids)} tokens) plus --generate {steps} exceeds model.max_seq_len={limit}")
    if arch == "encoder" and steps:
        raise ConfigError("--generate needs a decoder or an encoder-decoder; an encoder (masked LM) does not generate")
    recording = Recording()

    def pieces(seq: list[int]) -> list[str]:
        return display_tokens([codec.piece(i) for i in seq])

    if arch == "decoder":
        generated = record_decoder(model, ids, steps, recording)
        tokens = Tokens(pieces(ids + generated), [], len(ids), codec.decode(generated))
    elif arch == "encoder":
        with torch.no_grad(), observe_attention(model, recording):
            model(torch.tensor([ids]))
        tokens = Tokens(pieces(ids), [], len(ids))
    else:
        inputs, generated = record_seq2seq(model, ids, steps, recording)
        tokens = Tokens(pieces(ids), pieces(inputs), 0, codec.decode(generated))
    return recording.maps(), tokens


def axes(name: str, tokens: Tokens) -> tuple[list[str], list[str]]:
    """(query, key) token strings of the module ``name``."""
    if name.startswith("decoder."):
        return tokens.target, tokens.source if is_cross(name) else tokens.target
    return tokens.source, tokens.source


def parse_selection(spec: str, what: str) -> set[int] | None:
    """``"0,3"`` or ``"0-7"`` (or both: ``"0-2,5"``) as a set of indices; "" selects all."""
    if not spec:
        return None
    chosen: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            chosen.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"--{what} {spec!r} must be indices like 0,3 or a range like 0-7") from None
    return chosen


def windows(length: int, size: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) windows of at most ``size`` positions covering ``length``."""
    return [(s, min(s + size, length)) for s in range(0, length, size)]


@dataclass
class LayerReport:
    """What was written for one attention module: its heads' statistics and its pictures."""

    name: str
    stats: list[HeadStats]
    files: list[Path]


def draw_module(name: str, maps: torch.Tensor, heads: list[int], tokens: Tokens, out: Path, window: int) -> list[Path]:
    """One grid per window of ``window`` query x key positions (one grid when the text is short enough);
    windows of a causal map that hold no weight are skipped."""
    queries, keys = axes(name, tokens)
    split = None if name.startswith("decoder.") else tokens.prompt_rows
    blocks = [(q, k) for q in windows(len(queries), window) for k in windows(len(keys), window)]
    files = []
    for (q0, q1), (k0, k1) in blocks:
        block = maps[:, q0:q1, k0:k1]
        if len(blocks) > 1 and not bool(block.any()):
            continue
        suffix = "" if len(blocks) == 1 else f"_q{q0:04d}-{q1 - 1:04d}_k{k0:04d}-{k1 - 1:04d}"
        title = f"{layer_label(name)}: queries {q0}..{q1 - 1}, keys {k0}..{k1 - 1}"
        path = out / f"{layer_stem(name)}{suffix}.png"
        block_split = None if split is None else split - q0
        files.append(draw_layer(block, heads, queries[q0:q1], keys[k0:k1], title, path, block_split))
    return files


def load_for_inspection(path: str | Path) -> tuple[nn.Module, Codec, Path]:
    """The model (eval, CPU) of a run, checkpoint or HF directory, its tokenizer, and the directory they belong to."""
    from tessera.api import find_checkpoint, load
    from tessera.hf.weights import is_hf_dir

    model = load(path)
    model_dir = Path(path) if is_hf_dir(path) else find_checkpoint(path).parent.parent
    return model, load_codec(model_dir, model.cfg.arch), model_dir


def write_records(out: Path, maps: dict[str, torch.Tensor], tokens: Tokens, reports: list[LayerReport]) -> None:
    """attention.safetensors (the drawn heads' full maps), tokens.json and heads.tsv beside the pictures."""
    tensors = {layer_stem(r.name): maps[r.name][[s.head for s in r.stats]].contiguous() for r in reports}
    save_file(tensors, str(out / "attention.safetensors"))
    streams = {"source": tokens.source, "target": tokens.target, "prompt_rows": tokens.prompt_rows}
    (out / "tokens.json").write_text(json.dumps({**streams, "generated": tokens.generated}, indent=1) + "\n")
    lines = ["layer\thead\tentropy\tmean_distance\tfirst_token\tprevious_token"]
    for r in reports:
        for s in r.stats:
            values = (s.entropy, s.mean_distance, s.first_token, s.previous_token)
            lines.append("\t".join([layer_stem(r.name), str(s.head), *(f"{v:.6g}" for v in values)]))
    (out / "heads.tsv").write_text("\n".join(lines) + "\n")


def inspect_attention(
    path: str | Path,
    text: str,
    layers: str = "",
    heads: str = "",
    generate: int = 0,
    out: str | Path | None = None,
    window: int = 128,
) -> str:
    """Draw and summarize the attention of the model at ``path`` on ``text``; returns the report to print."""
    if generate < 0 or window < 2:
        raise ConfigError(f"--generate must be >= 0 and --window >= 2, got {generate} and {window}")
    layer_sel, head_sel = parse_selection(layers, "layers"), parse_selection(heads, "heads")
    model, codec, model_dir = load_for_inspection(path)
    maps, tokens = record(model, codec, text, generate)
    if not maps:
        raise ConfigError(f"'{path}' has no attention layers to inspect (model.layer_pattern is all Mamba)")
    chosen = {n: m for n, m in maps.items() if layer_sel is None or layer_index(n) in layer_sel}
    if not chosen:
        found = sorted({layer_index(n) for n in maps})
        raise ConfigError(f"--layers {layers} matches no attention layer; this model has layers {found}")
    out = Path(out) if out else model_dir / "attention"
    out.mkdir(parents=True, exist_ok=True)
    reports, lines = [], []
    for name, module_maps in chosen.items():
        selected = [h for h in range(module_maps.shape[0]) if head_sel is None or h in head_sel]
        if not selected:
            lines.append(f"{layer_label(name)}: none of --heads {heads} (it has {module_maps.shape[0]} heads)")
            continue
        stats = [s for s in head_stats(module_maps, self_attention=not is_cross(name)) if s.head in selected]
        files = draw_module(name, module_maps, selected, tokens, out, window)
        reports.append(LayerReport(name, stats, files))
        lines += [f"{layer_label(name)} -> {', '.join(str(f) for f in files)}", *format_table(stats)]
    if not reports:
        raise ConfigError(f"--heads {heads} selects no head of the chosen layers")
    write_records(out, chosen, tokens, reports)
    return "\n".join(
        _header(path, model, tokens, generate)
        + lines
        + [f"wrote {out}/ (PNGs, attention.safetensors, tokens.json, heads.tsv); {CAVEAT}"]
    )


def _header(path: str | Path, model: nn.Module, tokens: Tokens, generate: int) -> list[str]:
    cfg = model.cfg
    kernel = cfg.attention.kernel
    how = "recomputed with the eager kernel" if kernel_spec(kernel).scores else "implicit weights"
    lines = [
        f"attention of {path} ({cfg.arch}, model.attention.kernel={kernel}: {how}) on {len(tokens.source)} tokens"
        + (f" + {generate} generated (greedy)" if generate else "")
    ]
    if tokens.generated:
        lines.append(f"generated: {tokens.generated!r}")
    return lines
