"""``tessera plan``: the ranked table, its ordering, its errors, and the launchers' --gpu warning."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tessera.cli import main
from tessera.validate import load_config
from tessera.layout import check_layout
from tessera.plan import estimate, gpu, model_shape, plan
from tessera.plan.layouts import Layout
from tessera.plan.report import run_command


def test_plan_prints_a_ranked_table_a_measurement_and_a_command_that_runs(capsys):
    assert (
        main(["plan", "configs/tiny/llama.toml", "--gpus", "4", "--gpu", "h100-80gb", "--top", "3", "--measure"]) == 0
    )
    out = capsys.readouterr().out
    assert "4 x H100-80GB" in out and "efficiency 0.68" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    for column in (
        "params",
        "grads",
        "optim",
        "act",
        "logits",
        "pipe",
        "bufs",
        "compute",
        "comm",
        "bubble",
        "tok/s/GPU",
        "MFU",
    ):
        assert column in header
    assert [line.split()[0] for line in out.splitlines() if re.match(r"\s+[123]\s", line)] == ["1", "2", "3"]
    measured = re.search(r"--measure .*: ([\d.]+) GiB of tensors .* plan ([\d.]+) GiB .*\(([-+][\d.]+)%\)", out)
    assert measured and abs(float(measured.group(3))) < 10
    command = out.strip().splitlines()[-1].split()
    assert command[:5] == ["tessera", "launch", "configs/tiny/llama.toml", "--nproc-per-node", "4"]
    check_layout(load_config(command[2], command[5:]), 4)  # the suggested overrides are a valid 4-process job


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--gpus", "8", "--gpu", "h300"], "unknown GPU 'h300'; use one of a100-40gb"),
        (["--gpus", "0", "--gpu", "h100"], "--gpus must be positive"),
        (["--gpus", "7", "--gpu", "h100", "--train.batch_size", "8"], "no layout of 7 GPUs"),
    ],
)
def test_plan_errors_are_one_line_and_exit_2(capsys, flags, fragment):
    assert main(["plan", "configs/tiny/llama.toml", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def llama8b_on_16():
    config = load_config("configs/llama3-8b.toml", ["train.batch_size=32", "train.grad_accum=1"])
    return config, plan(config, 16, gpu("h100-80gb"))


def _index(p, **fields) -> int:
    return next(i for i, e in enumerate(p.estimates) if all(getattr(e.layout, k) == v for k, v in fields.items()))


def test_ranking_puts_fitting_and_faster_layouts_first(llama8b_on_16):
    _, p = llama8b_on_16
    fits = [e.fits for e in p.estimates]
    assert fits == sorted(fits, reverse=True), "every layout that fits ranks above every one that does not"
    speeds = [e.speed.tokens_per_s_per_gpu for e in p.estimates if e.fits]
    assert speeds[0] >= 0.97 * max(speeds)
    # Known good above known bad: interleaving shrinks the bubble; GPipe keeps every micro-batch in flight.
    same = {"dp_shard": 8, "pp": 2, "ac": "full", "micro_batch": 1, "reshard": True}
    assert _index(p, schedule="interleaved_1f1b", virtual=2, **same) < _index(p, schedule="1f1b", **same)
    assert _index(p, schedule="1f1b", **same) < _index(p, schedule="gpipe", **same)


def test_tensor_parallel_across_nodes_is_predicted_slower(llama8b_on_16):
    """The same tp=8 layout is slower when a node holds 4 GPUs (tp all-reduces cross the network) than 8."""
    config, p = llama8b_on_16
    layout = Layout(dp_shard=2, tp=8, micro_batch=1, microbatches=16, ac="op")
    inside = estimate(config, p.shape, layout, gpu("h100-80gb"))
    across = estimate(config, p.shape, layout, dataclasses.replace(gpu("h100-80gb"), gpus_per_node=4))
    assert across.speed.comm > 5 * inside.speed.comm and across.speed.step > inside.speed.step


def test_launch_and_slurm_warn_when_the_layout_will_not_fit(capsys):
    """llama3-8b's recipe (made for 8 x H100-80GB) cannot fit 8 x A100-40GB; the tiny recipe fits."""
    assert main(["launch", "configs/llama3-8b.toml", "--nproc-per-node", "8", "--gpu", "a100-40gb", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert re.search(
        r"tessera: warning: the planner predicts [\d.]+ GiB per GPU .* over the 40.0 GiB of an A100-40GB", err
    )
    assert (
        main(
            [
                "slurm",
                "configs/llama3-8b.toml",
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--device",
                "gpu",
                "--gpu",
                "a100-40gb",
                "--dry-run",
            ]
        )
        == 0
    )
    assert "tessera: warning: the planner predicts" in capsys.readouterr().err
    assert main(["launch", "configs/tiny/llama.toml", "--nproc-per-node", "2", "--gpu", "h100-80gb", "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_shape_of_a_full_size_recipe_matches_its_published_size():
    assert round(model_shape(load_config("configs/llama3-8b.toml").model).total / 1e9, 2) == 8.03


def test_enumeration_follows_the_compatibility_matrix(monkeypatch):
    """Only layouts the matrix allows: pp for an encoder-decoder until the matrix refuses it; cp for a dense
    decoder and for MoE (also with ep over the cp ranks) until the matrix refuses MoE with cp."""
    from tessera import registry
    from tessera.plan.layouts import candidate_layouts

    def refuse(kind: str, name: str, layout: str) -> None:  # the spec's declaration, replaced for this test
        spec = dataclasses.replace(registry.get(kind, name), unsupported={layout: "refused for this test"})
        monkeypatch.setitem(registry.REGISTRY[kind], name, spec)

    t5 = load_config("configs/tiny/t5.toml", ["train.batch_size=8"])
    assert any(lay.pp > 1 for lay in candidate_layouts(t5, 4, 8))  # issue 15: encoder-decoder pipelines
    assert not any(lay.cp > 1 for lay in candidate_layouts(t5, 4, 8))  # span lengths 58 and 13 do not cut in 4
    t5_61 = load_config("configs/tiny/t5.toml", ["train.batch_size=8", "train.seq_len=61"])  # 56 and 12
    assert any(lay.cp > 1 for lay in candidate_layouts(t5_61, 4, 8))  # encoder-decoders under cp: issue 32
    refuse("option", "encoder_decoder", "pp")
    layouts = list(candidate_layouts(t5, 4, 8))
    assert all(lay.pp == 1 for lay in layouts) and any(lay.tp > 1 for lay in layouts)
    dense = load_config("configs/tiny/llama.toml", ["train.batch_size=8"])
    assert any(lay.cp > 1 for lay in candidate_layouts(dense, 4, 8))  # cp: issue 14
    moe = load_config("configs/tiny/mixtral.toml", ["train.batch_size=8", "parallel.tp=1"])
    allowed = list(candidate_layouts(moe, 4, 8))
    assert any(lay.cp > 1 and lay.ep > 1 for lay in allowed)  # MoE under cp, ep over the cp ranks: issue 14
    assert all(moe.model.moe.experts % lay.ep == 0 and lay.shard % lay.ep == 0 for lay in allowed)
    refuse("ffn", "moe", "cp")
    refused = list(candidate_layouts(moe, 4, 8))
    assert refused and all(lay.cp == 1 for lay in refused) and any(lay.ep > 1 for lay in refused)  # ep: issue 13


@pytest.mark.parametrize("recipe", ["tiny/mamba", "tiny/jamba", "tiny/gpt2", "tiny/mixtral", "tiny/t5"])
def test_model_flops_never_exceed_the_timed_flops(recipe):
    """MFU <= the efficiency factor for every layout: what the MFU counts is never left out of the compute time."""
    config = load_config(f"configs/{recipe}.toml", ["train.batch_size=8", "train.dtype=bf16"])
    p = plan(config, 4, gpu("h100-80gb"))
    assert p.estimates and max(e.speed.mfu for e in p.estimates) <= gpu("h100-80gb").efficiency + 1e-9


def test_the_command_keeps_the_plans_own_overrides_and_its_stage_split():
    """What the plan was made with (seq_len, a cost-balanced split) reaches the command; the layout's keys win."""
    user = [
        "train.batch_size=32",
        "train.seq_len=4096",
        "parallel.pp=4",
        "parallel.layers_per_stage=cost",
        "train.grad_accum=1",
    ]
    p = plan(load_config("configs/llama3-8b.toml", user), 16, gpu("h100-80gb"))
    staged = next(e for e in p.estimates if e.fits and e.layout.pp == 2)
    words = run_command(p, "configs/llama3-8b.toml", staged, user).split()
    assert "train.seq_len=4096" in words and "parallel.pp=2" in words and "parallel.pp=4" not in words
    assert words.count("parallel.layers_per_stage=cost") == 1
    assert words.count("train.batch_size=32") == 1  # the layout's (global batch 32 per pipeline step), not twice
    config = load_config("configs/llama3-8b.toml", [w for w in words if "=" in w and not w.startswith("--")])
    assert config.train.seq_len == 4096 and config.parallel.pp == 2
    listed_user = [*user[:3], "parallel.layers_per_stage=8,8,8,8"]
    listed = plan(load_config("configs/llama3-8b.toml", listed_user), 16, gpu("h100-80gb"))
    by_stages = {
        e.layout.pp * e.layout.virtual: run_command(listed, "configs/llama3-8b.toml", e, listed_user).split()
        for e in listed.estimates
        if e.fits and e.layout.pp > 1
    }
    assert "parallel.layers_per_stage=8,8,8,8" in by_stages[4]  # the list fits a layout of 4 stages
    assert "parallel.layers_per_stage=" in by_stages[2]  # not one of 2: even counts there


def test_launch_finds_the_gpu_kind_itself_or_says_the_check_did_not_run(capsys, monkeypatch):
    """Without --gpu: a CUDA machine's own GPU is matched to the catalog; a GPU job of unknown kind gets a notice."""
    from tessera.plan.gpus import catalog_kind

    assert catalog_kind("NVIDIA H100 80GB HBM3", 79.6 * 2**30) == "h100-80gb"
    assert catalog_kind("NVIDIA A100-SXM4-40GB", 39.4 * 2**30) == "a100-40gb"
    assert catalog_kind("NVIDIA H200", 140 * 2**30) == "h200-141gb"
    assert catalog_kind("Tesla T4", 15 * 2**30) == ""
    monkeypatch.setattr("tessera.plan.local_gpu_kind", lambda: "a100-40gb")
    big = ["configs/llama3-8b.toml", "train.batch_size=512", "train.grad_accum=1", "train.device=cuda"]
    assert main(["launch", *big[:1], "--nproc-per-node", "8", "--dry-run", *big[1:]]) == 0
    assert "tessera: warning: the planner predicts" in capsys.readouterr().err
    monkeypatch.setattr("tessera.plan.local_gpu_kind", lambda: "")
    slurm = ["slurm", "configs/llama3-8b.toml", "--nodes", "1", "--gpus-per-node", "8", "--device", "gpu"]
    assert main([*slurm, "--dry-run"]) == 0
    assert "tessera: notice: the planner's fit check did not run" in capsys.readouterr().err
