"""The small Python API: load a model (and its tokenizer) from a run, a checkpoint or an HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from tessera import registry
from tessera.config import ConfigError
from tessera.data.tokenizer import Tokenizer
from tessera.hf.weights import is_hf_dir, load_hf
from tessera.model import build_model
from tessera.quantize.schemes import load_quantized_hf, quantization_config
from tessera.train.checkpoint import CHECKPOINT_DIR, Checkpointer, CheckpointError, latest_checkpoint, read_meta
from tessera.validate import config_from_dict


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a run directory (its newest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"'{path}' does not exist; give a run directory or a checkpoint directory")
    if is_hf_dir(path):
        raise CheckpointError(
            f"'{path}' is an HF model directory, not a tessera run (generate, eval and inspect read it as it is); "
            f"for this command import it first: tessera convert hf-import {path} RUN_DIR"
        )
    if (path / CHECKPOINT_DIR).is_dir() or (path / "config.toml").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"run directory '{path}' has no complete checkpoint yet")
        return found
    read_meta(path)
    return path


def load(path: str | Path) -> nn.Module:
    """The model of a tessera run directory, checkpoint or HF model directory, on CPU, in eval mode.

    Decoders take ``forward(input_ids)``, encoders ``forward(input_ids)`` (masked-LM logits) and
    encoder-decoders ``forward(input_ids, decoder_input_ids)``; all return logits.
    """
    if is_hf_dir(path):  # a torchao-quantized one (tessera convert quantize) stays quantized
        return load_quantized_hf(path) if quantization_config(path) else load_hf(path)
    return _load_checkpoint(find_checkpoint(path))


def _load_checkpoint(ckpt: Path) -> nn.Module:
    meta = read_meta(ckpt)
    config = config_from_dict(meta["config"], where=str(ckpt / "meta.json"))
    model = build_model(config.model)
    Checkpointer(ckpt.parent.parent, keep_last=1).load(ckpt, model, restore_rng=False)
    return model.eval()


def load_with_tokenizer(path: str | Path) -> tuple[nn.Module, Tokenizer]:
    """Model (eval mode, CPU) of a tessera run or checkpoint and the tokenizer the run trained with
    (``tokenizer.json`` or ``tokenizer.model`` in the run directory, see :meth:`Tokenizer.save`); or
    the model and tokenizer of an HF directory that holds one (an export of a run)."""
    if is_hf_dir(path):
        return load(path), Tokenizer(Path(path))
    ckpt = find_checkpoint(path)
    model = _load_checkpoint(ckpt)
    return model, Tokenizer(ckpt.parent.parent)


def load_draft(draft: str, model: nn.Module) -> Any:
    """The speculative-decoding draft of ``model``: "mtp" (its own multi-token-prediction modules) or a run,
    checkpoint or HF directory of a smaller decoder with the same vocabulary."""
    from tessera.model.speculative import ModelDraft, MTPDraft

    if model.cfg.arch != "decoder":
        raise ConfigError(f"--draft speculates for a decoder; this model is {model.cfg.arch!r}; drop --draft")
    _refuse_mamba(model, "the model")
    if draft == "mtp":
        if getattr(model, "mtp", None) is None:
            raise ConfigError("--draft mtp needs a model trained with model.mtp_depth > 0; this one has none")
        return MTPDraft(model)
    small = load(draft)
    if small.cfg.arch != "decoder" or small.cfg.vocab_size != model.cfg.vocab_size:
        raise ConfigError(
            f"--draft {draft} must be a decoder with the model's vocabulary ({model.cfg.vocab_size} tokens), got "
            f"{small.cfg.arch} with {small.cfg.vocab_size}; train the draft with the same tokenizer"
        )
    _refuse_mamba(small, f"--draft {draft}")
    return ModelDraft(small)


def _refuse_mamba(model: nn.Module, what: str) -> None:
    recurrent = registry.recurrent_layers(getattr(model, "layers", {}).values())
    if recurrent:
        raise ConfigError(
            f"speculative decoding rewinds caches, but {what} has {recurrent} (model.layer_pattern="
            f"{model.cfg.layer_pattern!r}), whose state cannot rewind; drop --draft or use an attention-only model"
        )


def check_draft_fits(draft: str, drafter: Any, model: nn.Module, total: int, draft_tokens: int) -> None:
    """Refuse, before decoding, a draft that cannot propose what is asked: more tokens than the MTP modules
    predict, or a draft model whose context is shorter than the ``total`` positions the decoding reaches."""
    if draft == "mtp":
        depth = model.cfg.mtp_depth
        if draft_tokens > depth:
            raise ConfigError(
                f"--draft mtp proposes at most model.mtp_depth={depth} tokens per round, asked --draft-tokens "
                f"{draft_tokens}; lower --draft-tokens"
            )
        return
    context = drafter.model.cfg.max_seq_len
    if context < total:
        raise ConfigError(
            f"--draft {draft} has a context of {context} tokens (its model.max_seq_len) but this decoding reaches "
            f"{total} (prompt + --max-new-tokens); lower --max-new-tokens or use a draft with a longer context"
        )


def _check_generative(model: nn.Module, path: str | Path) -> None:
    if model.cfg.arch == "encoder":
        raise ConfigError(
            f"'{path}' is an encoder (masked LM); it fills in masked tokens and does not generate text. "
            "tessera generate needs a decoder or encoder-decoder run"
        )


def generate_text(
    path: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    kv_cache: str = "auto",
    draft: str = "",
    draft_tokens: int = 4,
) -> tuple[str, str]:
    """``prompt`` and its continuation sampled from a run or checkpoint (``tessera generate``), and lines on the
    decoding: the cache's size (bytes per token of context, by ``kv_cache`` kind) and, with a ``draft``
    ("mtp" or a draft model's directory; see :func:`load_draft`), speculative decoding's acceptance."""
    import time

    import torch

    from tessera.model import generate
    from tessera.model.cache import CACHE_KINDS, cache_footprint
    from tessera.model.speculative import Sampler, speculative_generate

    if kv_cache not in CACHE_KINDS:
        raise ConfigError(f"--kv-cache {kv_cache!r} is not one of {', '.join(CACHE_KINDS)}")
    if draft_tokens < 1:
        raise ConfigError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    model, tokenizer = load_with_tokenizer(path)
    _check_generative(model, path)
    ids = torch.tensor([tokenizer.prompt_ids(prompt)])
    if ids.shape[1] >= model.cfg.max_seq_len:
        raise ConfigError(
            f"--prompt is {ids.shape[1]} tokens but the model's context (model.max_seq_len) is "
            f"{model.cfg.max_seq_len}; shorten the prompt"
        )
    gen = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    lines = []
    if draft:
        sampler = Sampler(temperature, top_k, top_p, gen)
        drafter = load_draft(draft, model)
        check_draft_fits(draft, drafter, model, min(ids.shape[1] + max_new_tokens, model.cfg.max_seq_len), draft_tokens)
        out, stats = speculative_generate(
            model, drafter, ids, max_new_tokens, draft_tokens, sampler, tokenizer.eos_id, kv_cache
        )
        lines.append(
            f"speculative decoding ({draft}, {draft_tokens} draft tokens): {stats.accepted}/{stats.proposed} drafts "
            f"accepted ({stats.acceptance_rate:.0%}), {stats.tokens_per_round:.2f} tokens per forward of the model"
        )
    else:
        out = generate(model, ids, max_new_tokens, temperature, top_k, top_p, tokenizer.eos_id, gen, kv_cache=kv_cache)
    seconds = time.perf_counter() - started
    per_token, fixed = cache_footprint(model, kv_cache)
    lines.insert(0, f"decoding cache ({kv_cache}): {per_token:,} bytes per token of context, {fixed:,} bytes fixed")
    lines.append(f"{out.shape[1]} tokens in {seconds:.2f}s ({out.shape[1] / max(seconds, 1e-9):.1f} tokens/s)")
    return prompt + tokenizer.decode(out[0].tolist()), "\n".join(lines)


def _run_config(path: str | Path):
    """The JobConfig a run or checkpoint was trained with (None for an HF model directory)."""
    if is_hf_dir(path):
        return None
    meta = read_meta(find_checkpoint(path))
    return config_from_dict(meta["config"], where=str(path))


def evaluation_tokens(path: str | Path, data: str, budget: int) -> Any:
    """Up to ``budget`` + 1 tokens to score: the indexed dataset ``data`` (PREFIX.bin/.idx), else the
    validation split of the run's own data (its documents in order, concatenated)."""
    import numpy as np

    from tessera.data.dataset import open_indexed

    if data:
        indexed, docs = open_indexed(data), None
    else:
        config = _run_config(path)
        if config is None:
            raise ConfigError(f"'{path}' is an HF model directory: give the text to score with --data PREFIX")
        from tessera.data.pipeline import build_data

        val = build_data(config).val
        if val is None:
            raise ConfigError(f"run '{path}' has no validation split (data.val_fraction=0): give --data PREFIX")
        indexed, docs = val.gpt.dataset, val.gpt.indices
    parts, total = [], 0
    for d in docs if docs is not None else range(len(indexed)):
        parts.append(np.asarray(indexed[int(d)]))
        total += len(parts[-1])
        if total > budget:
            break
    return np.concatenate(parts)[: budget + 1] if parts else np.zeros(0, dtype=np.int64)


def evaluate_lengths(
    path: str | Path, lengths: str, scalings: str, data: str = "", budget: int = 32768, seq_len: int = 0
) -> tuple[list[Any], int]:
    """Perplexity rows (:class:`tessera.evaluate.lengths.LengthRow`) of a run, checkpoint or HF directory at
    ``lengths`` (multiples of the training length ``seq_len``, default the run's ``train.seq_len``) for each
    RoPE scaling, and the base length used."""
    from tessera.evaluate.lengths import check_length, length_table, parse_lengths, parse_scalings

    model = load(path)
    config = _run_config(path)
    base = seq_len or (config.train.seq_len if config is not None else model.cfg.max_seq_len)
    wanted = parse_lengths(lengths, base)
    names = parse_scalings(scalings, model.cfg)
    for length in wanted:  # before any data is read
        check_length(model.cfg, length)
    stream = evaluation_tokens(path, data, max(budget, max(wanted) + 1))
    return length_table(model, stream, base, wanted, names, budget), base
