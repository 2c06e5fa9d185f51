"""The component registry: every registered component declares its checks, the layouts it does not
support (with reasons) and its planner terms; dispatch, rules and the compatibility table read it."""

from __future__ import annotations

import dataclasses

import pytest

from tessera import compat, registry
from tessera.config import JobConfig
from tessera.config.docs import sections
from tessera.errors import ConfigError
from tessera.model import components  # noqa: F401  (registers the zoo's specs)
from tessera.validate import validate


def _all_keys() -> set[str]:
    found = set()
    for section in sections():
        found.add(section.name)
        found.update(k.key for k in section.keys)
    return found


def test_every_registered_component_declares_checks_unsupported_layouts_and_planner_terms():
    problems = [p for spec in registry.specs() for p in registry.declaration_problems(spec, compat.LAYOUTS)]
    assert problems == []
    assert {s.name for s in registry.specs("attention_kernel")} >= {"sdpa", "eager", "longformer", "bigbird"}
    assert {s.name for s in registry.specs("mixer")} >= {"attention", "latent", "mamba", "mamba2"}


def test_a_component_missing_a_declaration_is_named():
    spec = registry.get("attention_kernel", "sdpa")
    bare = dataclasses.replace(spec, name="bare", checks=None, unsupported=None, terms=None, tp_plan=None)
    problems = " | ".join(registry.declaration_problems(bare, compat.LAYOUTS))
    for what in ("no checks", "no unsupported layouts", "no planner terms", "no tp_plan"):
        assert what in problems
    odd = dataclasses.replace(spec, unsupported={"warp": "a layout that does not exist"})
    assert "not a registered layout" in " ".join(registry.declaration_problems(odd, compat.LAYOUTS))


def test_every_declared_config_key_exists():
    keys = _all_keys()
    unknown = [(s.kind, s.name, k) for s in registry.specs() for k in s.keys if k not in keys]
    assert unknown == []


def test_specs_sharing_a_table_row_refuse_the_same_layouts():
    rows: dict[str, dict[str, str]] = {}
    for spec in registry.specs():
        assert rows.setdefault(spec.feature, dict(spec.unsupported or {})) == dict(spec.unsupported or {}), spec.name


def test_register_refuses_a_taken_name_and_get_names_the_registered_ones():
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("attention_kernel", "sdpa"))
    with pytest.raises(KeyError, match="registered: sdpa"):
        registry.get("attention_kernel", "nope")


def test_a_declared_refusal_reaches_validation(monkeypatch):
    """What a spec declares is what validation refuses: a kernel's refusal of tp, replaced for this test."""
    job = JobConfig()
    job.parallel.tp = 2
    validate(job)
    spec = dataclasses.replace(registry.get("attention_kernel", "sdpa"), unsupported={"tp": "refused by the test"})
    monkeypatch.setitem(registry.REGISTRY["attention_kernel"], "sdpa", spec)
    with pytest.raises(ConfigError, match="refused by the test"):
        validate(job)


def test_a_kernel_check_runs_only_for_its_kernel():
    job = JobConfig()
    job.model.attention.kernel = "longformer"
    with pytest.raises(ConfigError, match="longformer' needs model.attention.sliding_window"):
        validate(job)
    job.model.attention.kernel = "nope"
    with pytest.raises(ConfigError, match="not a registered kernel; use one of 'sdpa', 'eager'"):
        validate(job)


@pytest.mark.parametrize("recipe", ["tiny/llama", "tiny/jamba", "tiny/mamba", "tiny/deepseek_v3"])
def test_one_mfu_count_and_the_planner_times_each_mixers_term(recipe):
    """One MFU numerator for both (train.flops); the planner's timed score work is each mixer's registered term."""
    from tessera.config import read_config
    from tessera.model.mixers import layer_kind
    from tessera.plan import model_shape
    from tessera.plan.speed import _score_flops
    from tessera.train.flops import flops_per_token

    cfg = read_config(f"configs/{recipe}.toml").model
    seq = 64
    attention_layers = sum(layer_kind(cfg, i) != "M" for i in range(cfg.n_layers))
    want = attention_layers * 12.0 * cfg.n_heads * (cfg.head_dim or cfg.dim // cfg.n_heads) * seq
    shape = model_shape(cfg)
    assert shape.flops_per_token(seq) == flops_per_token(cfg, seq)
    assert sum(_score_flops(shape, block, seq) for block in shape.blocks) == want
