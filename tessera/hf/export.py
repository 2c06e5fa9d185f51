"""The rest of an exported HF model directory: tokenizer files, generation_config.json, a model card.

``hf/weights.py`` writes the weights and config.json; this adds what ``AutoTokenizer`` and
``generate`` need and a README.md that says how the model was trained (from the checkpoint's
config and the run's metrics.jsonl).

The run's SentencePiece model becomes a ``tokenizer.json`` (built by transformers' SentencePiece
converter) wrapped as ``PreTrainedTokenizerFast``, with tessera's newline symbol mapped in the
normalizer and the decoder, so HF ids equal tessera's. ``LlamaTokenizer`` is not used: since
transformers 5 it rebuilds its own normalizer and would encode newlines differently from training.
The ``tokenizer.model`` itself is copied too, for SentencePiece users.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tessera.data.tokenizer import NEWLINE, Tokenizer

_TASKS = {
    "decoder": ("text-generation", "AutoModelForCausalLM"),
    "encoder": ("fill-mask", "AutoModelForMaskedLM"),
    "encoder_decoder": ("text2text-generation", "AutoModelForSeq2SeqLM"),
}


def write_tokenizer(tokenizer_path: Path, out: Path, max_len: int) -> Tokenizer:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and tokenizer.model in ``out``."""
    from tokenizers import decoders, normalizers, processors
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    tok = Tokenizer(tokenizer_path)
    sp = tok.backend.sp
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(tokenizer_path.read_bytes())
    fast = SpmConverter.build_tokenizer_from_spm_proto(proto, {p.piece: i for i, p in enumerate(proto.pieces)})
    if tok.backend.newline:  # tessera's own models map newlines to one piece; others encode them themselves
        fast.normalizer = normalizers.Sequence([normalizers.Replace("\n", NEWLINE), fast.normalizer])
        fast.decoder = decoders.Sequence([fast.decoder, decoders.Replace(NEWLINE, "\n")])
    bos = sp.id_to_piece(tok.bos_id)
    fast.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
    )
    fast.save(str(out / "tokenizer.json"))
    shutil.copyfile(tokenizer_path, out / "tokenizer.model")
    ids = {k: getattr(tok, f"{k}_id") for k in ("bos", "eos", "pad")}
    special = {f"{k}_token": sp.id_to_piece(i) for k, i in ids.items() if i is not None}
    special["unk_token"] = sp.id_to_piece(sp.unk_id())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok


def export_tokenizer(run_dir: Path, out: Path, max_len: int) -> Tokenizer | None:
    """The run's tokenizer into ``out``: an HF tokenizer (imported, or trained with one) as it is, a
    SentencePiece model converted by :func:`write_tokenizer`; None when the run has neither."""
    if (run_dir / "tokenizer.json").is_file():
        tok = Tokenizer(run_dir)
        tok.save(out)
        return tok
    if (run_dir / "tokenizer.model").is_file():
        return write_tokenizer(run_dir / "tokenizer.model", out, max_len)
    return None


def write_generation_config(out: Path, tok: Tokenizer | None) -> None:
    """generation_config.json (special ids; greedy by default) and the same ids in config.json."""
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id} if tok else {}
    (out / "generation_config.json").write_text(json.dumps({**ids, "do_sample": False}, indent=2) + "\n")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **ids}, indent=2) + "\n")


def _final_metrics(run_dir: Path, step: int) -> dict[str, float]:
    """The last training loss and validation loss at or before ``step`` in the run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    found: dict[str, float] = {}
    if not path.is_file():
        return found
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            found.update({k: record[k] for k in ("loss", "val_loss") if isinstance(record.get(k), float)})
    return found


def _training_lines(meta: dict[str, Any], run_dir: Path) -> list[str]:
    """How the checkpoint was made, one Markdown bullet each."""
    if "imported_from" in meta:
        src = meta["imported_from"]
        return [f"- Imported from the HF {src['family']} checkpoint `{src['path']}`; not trained by tessera."]
    c, step = meta["config"], int(meta["step"])
    t, o, d, p = c["train"], c["optim"], c["data"], c["parallel"]
    tokens = step * t["batch_size"] * t["grad_accum"] * t["seq_len"]
    layout = ", ".join(f"{k}={v}" for k, v in p.items() if k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"))
    lines = [
        (
            f"- Trained with tessera for {step} steps: {tokens:,} tokens in sequences of {t['seq_len']} "
            f"({t['batch_size']} per step x {t['grad_accum']} accumulated), {t['dtype']}."
        ),
        f"- Data: `{d.get('blend_schedule') or d['blend'] or d['source']}`; tokenizer: `{d['tokenizer']}`.",
        (
            f"- Optimizer: AdamW, lr {o['lr']} ({o['schedule']}, {o['warmup_steps']} warmup steps), weight decay "
            f"{o['weight_decay']}, betas ({o['beta1']}, {o['beta2']}), gradient clipping {o['grad_clip']}."
        ),
        f"- Seed {t['seed']}; parallel layout {layout}.",
    ]
    if t.get("init_from"):  # continued pretraining: where the first weights came from
        lines.insert(0, f"- Initialized from `{t['init_from']}` (weights only), then trained as below.")
    metrics = _final_metrics(run_dir, step)
    if metrics:
        names = {"loss": "training loss", "val_loss": "validation loss"}
        lines.append("- Final " + ", ".join(f"{names[k]} {metrics[k]:.4f}" for k in names if k in metrics) + ".")
    return lines


def write_model_card(out: Path, meta: dict[str, Any], run_dir: Path, family: str, parameters: int) -> None:
    """README.md: what the model is and how it was trained."""
    model = meta["config"]["model"]
    task, auto = _TASKS[model["arch"]]
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {task}",
        "tags: [tessera]",
        "---",
        "",
        f"# {run_dir.name}",
        "",
        (
            f"A {parameters:,}-parameter {family} model ({model['n_layers']} layers, width {model['dim']}, "
            f"vocabulary {model['vocab_size']}, context {model['max_seq_len']}), exported from a tessera checkpoint."
        ),
        "",
        "## Training",
        "",
        *_training_lines(meta, run_dir),
        "",
        "## Use",
        "",
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        f'model = {auto}.from_pretrained("PATH")',
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def complete_hf_dir(out: Path, ckpt: Path, family: str, parameters: int) -> None:
    """Add tokenizer files (when the run has a tokenizer), generation config and model card to ``out``."""
    from tessera.train.checkpoint import read_meta

    run_dir, meta = ckpt.parent.parent, read_meta(ckpt)
    tok = export_tokenizer(run_dir, out, int(meta["config"]["model"]["max_seq_len"]))
    write_generation_config(out, tok)
    write_model_card(out, meta, run_dir, family, parameters)
