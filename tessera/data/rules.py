"""The rules of the [data] keys, and the training objective against the architecture and the vocabulary."""

from __future__ import annotations

import re

from tessera.config import DataConfig, ModelConfig, TrainConfig, resolved_objective
from tessera.config.checks import require
from tessera.data.mixture import parse_blend_schedule
from tessera.data.objectives import span_count, span_lengths
from tessera.data.sources import DataError
from tessera.errors import ConfigError


def check_objective(m: ModelConfig, t: TrainConfig) -> None:
    """The training objective fits the architecture and has its reserved token ids."""
    objective = resolved_objective(m)
    wanted = {"causal_lm": "decoder", "masked_lm": "encoder", "span_corruption": "encoder_decoder"}[objective]
    require(m.arch == wanted, f"model.objective='{objective}' trains arch='{wanted}', not model.arch='{m.arch}'")
    needed = {
        "causal_lm": 0,
        "masked_lm": 1,
        "span_corruption": span_count(t.seq_len + 1, m.mask_prob, m.mean_span_length),
    }[objective]
    require(
        m.sentinel_tokens >= needed,
        f"model.objective='{objective}' with train.seq_len={t.seq_len} needs model.sentinel_tokens >= {needed} (ids "
        f"reserved at the top of the vocab), got {m.sentinel_tokens}",
    )
    require(
        m.vocab_size > m.sentinel_tokens,
        f"model.sentinel_tokens={m.sentinel_tokens} leaves no ids of model.vocab_size={m.vocab_size} for the tokenizer",
    )


def check_objective_split(m: ModelConfig, t: TrainConfig, cp: int) -> None:
    """Under context parallelism span corruption's encoder and decoder sequences each cut into 2 x cp equal
    chunks (their lengths follow from train.seq_len, model.mask_prob and model.mean_span_length)."""
    if cp == 1 or resolved_objective(m) != "span_corruption":
        return
    density, span = m.mask_prob, m.mean_span_length
    fits = lambda n: all(x % (2 * cp) == 0 for x in span_lengths(n + 1, density, span))  # noqa: E731
    if fits(t.seq_len):
        return
    enc, dec = span_lengths(t.seq_len + 1, density, span)
    near = [n for n in range(max(t.seq_len - 64 * cp, 2), t.seq_len + 64 * cp) if fits(n)]
    near = sorted(near, key=lambda n: abs(n - t.seq_len))[:3]
    hint = f"e.g. train.seq_len={' or '.join(map(str, sorted(near)))}" if near else "change train.seq_len"
    raise ConfigError(
        f"model.objective='span_corruption' with train.seq_len={t.seq_len} gives encoder sequences of {enc} and "
        f"decoder sequences of {dec} tokens; parallel.cp={cp} cuts each into 2 x cp={2 * cp} equal chunks, so both "
        f"must be multiples of {2 * cp}: {hint}, or parallel.cp=1"
    )


def check_data(d: DataConfig) -> None:
    require(0.0 <= d.val_fraction < 0.5, f"data.val_fraction must be in [0, 0.5), got {d.val_fraction}")
    require(d.max_chars >= 0, f"data.max_chars must be >= 0 (0 = all), got {d.max_chars}")
    require(d.tokenizer_chars > 0, f"data.tokenizer_chars must be positive, got {d.tokenizer_chars}")
    require(d.num_proc >= 1, f"data.num_proc must be >= 1, got {d.num_proc}")
    require(d.prefetch >= 0, f"data.prefetch must be >= 0 (0 = no background thread), got {d.prefetch}")
    require(bool(d.text_field), "data.text_field must name the field that holds the text, e.g. 'text'")
    require(
        not d.split or re.fullmatch(r"\d+(\.\d*)?(,\d+(\.\d*)?){0,2}", d.split.replace(" ", "")) is not None,
        f"data.split={d.split!r} must be up to three comma-separated numbers train,valid,test, e.g. '98,1,1'",
    )
    require(
        not (d.blend and d.source != "default"),
        "data.blend and data.source are both set; use data.source for raw text or data.blend for prepared datasets, "
        "not both",
    )
    require(
        not (d.blend or d.blend_schedule) or d.tokenizer not in ("default", "bpe"),
        "data.blend and data.blend_schedule need data.tokenizer = the tokenizer the datasets were prepared with "
        "(.model, tokenizer.json or HF directory)",
    )
    require(
        not (d.blend_schedule and (d.blend or d.source != "default")),
        "data.blend_schedule names its datasets itself; leave data.blend and data.source unset",
    )


def check_blend_schedule(schedule: str, steps: int) -> None:
    if schedule:
        try:
            parse_blend_schedule(schedule, steps)
        except DataError as err:
            raise ConfigError(str(err)) from None
