"""data.blend_schedule: weights by step range, realized per phase, one stream resumable at any step and dp size."""

from __future__ import annotations

import json

import pytest
from test_blend import EOD, write_megatron_dataset

from tessera.config import ConfigError
from tessera.validate import load_config
from tessera.data.loader import SequenceLoader
from tessera.data.mixture import Phase, overall_weights, parse_blend_schedule
from tessera.data.pipeline import BLEND_PHASES
from tessera.data.schedule import build_scheduled_splits
from tessera.data.sources import DataError
from tessera.train.trainer import train

RANGES = {"web": (10, 100), "code": (110, 190), "hq": (200, 290)}  # token ids (below the 300-token tokenizer)


@pytest.fixture(scope="module")
def three_datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedule")
    for seed, (name, (low, high)) in enumerate(RANGES.items()):
        write_megatron_dataset(root / name, 600 if name == "hq" else 2000, low, high, seed=seed)
    return root


def _schedule(root, steps: int = 40) -> list[Phase]:
    text = f"0: 0.7 {root}/web 0.3 {root}/code; 50%: 1 {root}/code; 75%: 0.2 {root}/web 0.8 {root}/hq"
    return parse_blend_schedule(text, steps)


def test_parse_steps_percentages_and_errors():
    phases = parse_blend_schedule("0: 3 a 1 b; 900: b; 95%: 1 a 1 c", 1000)
    assert phases == [
        Phase(0, 900, ("a", "b"), (0.75, 0.25)),
        Phase(900, 950, ("b",), (1.0,)),
        Phase(950, 1000, ("a", "c"), (0.5, 0.5)),
    ]
    assert overall_weights(phases) == pytest.approx([0.75 * 0.9 + 0.025, 0.25 * 0.9 + 0.05, 0.025])
    for text, message in [
        ("10: a", "the first phase must start at step 0, not 10"),
        ("0: a; 50%: b; 40%: c", "phase 2 starts at step 500 but the next boundary is 400"),
        ("0: a; 1000: b", "phase 2 starts at step 1000 but the next boundary is 1000"),
        ("0: a; soon: b", "phase 2 starts at 'soon'"),
        ("0: 1 a 1 a", "phase 1 names a dataset twice"),
        ("0: a; 0.5 b", "phase 2 '0.5 b' has no 'START:'"),
        ("0: x0.5 a 1 b", "phase 1: weight 'x0.5' for 'a' is not a number"),
    ]:
        with pytest.raises(DataError, match=message):
            parse_blend_schedule(text, 1000)
    with pytest.raises(ConfigError, match=r"data.blend_schedule: the first phase must start at step 0"):
        load_config(None, ["data.blend_schedule=5: a", "data.tokenizer=t.model"])
    with pytest.raises(ConfigError, match="leave data.blend and data.source unset"):
        load_config(None, ["data.blend_schedule=0: a", "data.blend=b", "data.tokenizer=t.model"])


def test_each_phase_draws_its_own_mix_and_datasets_continue_across_phases(three_datasets, tmp_path):
    phases = _schedule(three_datasets)
    stream = build_scheduled_splits(phases, "98,2,0", 32, 1, EOD, 500, tmp_path, samples_per_step=24)["train"]
    assert len(stream) == 40 * 24
    targets = [{"web": 0.7, "code": 0.3}, {"code": 1.0}, {"web": 0.2, "hq": 0.8}]
    for n, target in enumerate(targets):
        realized = {k.rsplit("/", 1)[1]: v for k, v in stream.realized_mix(n).items() if v}
        assert realized == pytest.approx(target, abs=1 / (10 * 24))  # exact up to one sample
    for i in range(0, len(stream), 7):  # every sample comes from the dataset the index names
        window, name = stream[i], stream.prefixes[stream.source_of(i)].rsplit("/", 1)[1]
        low, high = RANGES[name]
        assert ((window == EOD) | ((window >= low) & (window < high))).all()
    web = [int(stream.sample_index[i]) for i in range(len(stream)) if stream.source_of(i) == 0]
    assert web == list(range(len(web)))  # web resumes in phase 3 where phase 1 left it: no sample repeats
    assert stream.phase_report(20)["realized"] == stream.realized_mix(0) and stream.phase_report(21) is None


def _global_ids(loaders: list[SequenceLoader], steps: int) -> list[list[int]]:
    out = []
    for _ in range(steps):
        batches = [loader.next_batch() for loader in loaders]
        out.append([int(t) for b in batches for t in b.tokens[:, :4].flatten()])
    return out


@pytest.mark.parametrize("resume_step, new_dp", [(13, 1), (13, 4), (29, 2)])
def test_stream_resumes_at_any_step_on_any_dp_size(three_datasets, tmp_path, resume_step, new_dp):
    stream = build_scheduled_splits(_schedule(three_datasets), "98,2,0", 32, 1, EOD, 500, tmp_path, 24)["train"]
    reference = _global_ids([SequenceLoader(stream, 24, 7, prefetch=0)], 40)
    first = [SequenceLoader(stream, 12, 7, r, 2, prefetch=2) for r in range(2)]
    assert _global_ids(first, resume_step) == reference[:resume_step]
    state = first[0].state_dict()
    again = build_scheduled_splits(_schedule(three_datasets), "98,2,0", 32, 1, EOD, 500, tmp_path, 24)["train"]
    resumed = [SequenceLoader(again, 24 // new_dp, 7, r, new_dp, prefetch=1) for r in range(new_dp)]
    for loader in resumed:
        loader.load_state_dict(state)
    assert _global_ids(resumed, 40 - resume_step) == reference[resume_step:]


def test_training_logs_the_realized_mix_per_phase_and_resumes_bitwise(
    three_datasets, tiny_config, small_tokenizer, tmp_path, capsys
):
    root = three_datasets
    schedule = f"0: 0.5 {root}/web 0.5 {root}/code; 6: 0.25 {root}/web 0.75 {root}/hq"
    common = (
        "train.steps=8",
        "optim.schedule=constant",
        f"data.blend_schedule={schedule}",
        f"data.tokenizer={small_tokenizer}",
        "data.split=98,2,0",
        "log.progress=lines",
    )
    full = train(tiny_config(*common, run_dir=tmp_path / "full"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("blend phase")]
    assert lines[0].startswith("blend phase 1/2 (steps 1-6, 24 samples) realized: web 50.0% (target 50.0%)")
    assert lines[1].startswith("blend phase 2/2 (steps 7-8, 8 samples) realized: web 25.0% (target 25.0%)")
    records = [json.loads(r) for r in (tmp_path / "full" / BLEND_PHASES).read_text().splitlines()]
    assert [r["phase"] for r in records] == [1, 2] and records[1]["realized"][f"{root}/hq"] == 0.75
    (tmp_path / "full" / "checkpoints" / "step_00000008").rename(tmp_path / "dropped")  # resume from step 4
    resumed = train(tiny_config(*common, run_dir=tmp_path / "full"))
    assert resumed.losses == full.losses[4:]  # across the phase boundary at step 6
