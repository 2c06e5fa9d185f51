"""Muon, bf16 optimizer state and QK-clip on one process: numerics against torch.optim.Muon and AdamW,
orthogonality, parameter selection, shard layouts against DTensor's, checkpoints and resume refusals."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.config import ConfigError, MuonConfig, OptimConfig, model_config
from tessera.validate import load_config
from tessera.model import build_model
from tessera.model.attention import _allowed
from tessera.parallel.muon import NS_COEFFICIENTS, newton_schulz, shard_indices
from tessera.train.checkpoint import CheckpointError
from tessera.train.optim import build_optimizer, muon_parameters, parameter_groups
from tessera.train.qk_clip import QKClip
from tessera.train.trainer import train

MODEL = {"vocab_size": 300, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "tie_embeddings": False}


def _model(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config(**{**MODEL, **extra}))


def _backward(model: torch.nn.Module, seed: int) -> None:
    """Gradients of a random next-token loss."""
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48)])
def test_newton_schulz_is_torch_muons_and_orthogonalizes(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(newton_schulz(g, 5, torch.bfloat16), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7))
    skewed = g * torch.logspace(0, -1, shape[1])  # singular values spread over 10x to 300x
    assert torch.linalg.svdvals(skewed).max() / torch.linalg.svdvals(skewed).min() > 9
    for matrix in (g, skewed):
        singular = torch.linalg.svdvals(newton_schulz(matrix, 5, torch.float32))
        assert singular.min() > 0.55 and singular.max() < 1.25, singular  # Keller Jordan's quintic: ~U(0.7, 1.15)


def test_expert_stacks_are_orthogonalized_per_expert():
    stack = (
        torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(2))
        * torch.tensor([1.0, 100.0, 0.01])[:, None, None]
    )
    out = newton_schulz(stack, 5, torch.float32)
    for e in range(3):
        torch.testing.assert_close(out[e], newton_schulz(stack[e], 5, torch.float32), rtol=1e-5, atol=1e-6)
        singular = torch.linalg.svdvals(out[e])
        assert singular.min() > 0.55 and singular.max() < 1.25


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = _model(moe={"experts": 4, "top_k": 2}, qkv_bias=True)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in muon_parameters(model)}
    assert "layers.0.attention.q_proj.weight" in muon and "layers.1.attention.o_proj.weight" in muon
    assert "layers.0.moe.experts.up_proj" in muon and "layers.0.moe.router.weight" in muon
    assert not muon & {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention.q_proj.bias"}
    groups = build_optimizer(model, OptimConfig(name="muon", muon=MuonConfig(lr=0.02), lr=1e-3)).param_groups
    assert [g["muon"] for g in groups] == [True, False, False] and groups[0]["lr"] == 0.02 and groups[1]["lr"] == 1e-3
    assert {names[id(p)] for p in groups[0]["params"]} == muon
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    tied = _model(tie_embeddings=True)
    assert all(p is not tied.tok_embeddings.weight for p in muon_parameters(tied))


@pytest.mark.parametrize("scale,torch_rule", [("rms", "match_rms_adamw"), ("spectral", "original")])
@pytest.mark.parametrize("nesterov", [True, False])
def test_update_equals_torch_muon_and_adamw(scale, torch_rule, nesterov):
    """Three steps of tessera's Muon+AdamW against torch.optim.Muon on the matrices and AdamW on the rest."""
    model, twin = _model(), _model()
    cfg = OptimConfig(name="muon", lr=1e-2, muon=MuonConfig(lr=0.05, scale=scale, nesterov=nesterov, momentum=0.9))
    ours = build_optimizer(model, cfg)
    matrices = muon_parameters(twin)
    rest = parameter_groups(twin, cfg.weight_decay)
    for group in rest:
        group["params"] = [p for p in group["params"] if all(p is not m for m in matrices)]
    reference = [
        torch.optim.Muon(matrices, lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=torch_rule),
        torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True),  # optim.implementation=auto
    ]
    for step in range(3):
        _backward(model, step)
        _backward(twin, step)
        ours.step()
        for opt in reference:
            opt.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert (model.layers["0"].attention.q_proj.weight - _model().layers["0"].attention.q_proj.weight).abs().max() > 1e-3


def test_bf16_state_keeps_moments_in_bf16_and_tracks_fp32():
    results = {}
    for name in ("adamw", "muon"):
        for dtype in ("fp32", "bf16"):
            model = _model()
            opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2, state_dtype=dtype))
            for step in range(5):
                _backward(model, step)
                opt.step()
            dtypes = {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"}
            assert dtypes == {torch.bfloat16 if dtype == "bf16" else torch.float32}
            results[name, dtype] = torch.cat([p.detach().flatten() for p in model.parameters()])
    fp32_adamw = build_optimizer(_model(), OptimConfig(name="adamw", state_dtype="fp32"))
    assert type(fp32_adamw) is torch.optim.AdamW  # fp32 AdamW stays torch's own
    for name in ("adamw", "muon"):
        moved = (results[name, "fp32"] - _flat(_model())).norm()
        gap = (results[name, "bf16"] - results[name, "fp32"]).norm()
        assert 0 < gap < 0.05 * moved, (name, gap, moved)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("shape", [(13, 6), (16, 8), (3, 5)])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 2), (3,)])
def test_shard_indices_agree_with_dtensor(shape, mesh_shape):
    layouts = {
        (3,): [(Shard(0),), (Shard(1),), (Replicate(),)],
        (2, 2): [
            (Shard(0), Shard(1)),
            (Replicate(), Shard(0)),
            (Shard(1), Shard(1)),
            (_StridedShard(0, split_factor=2), Shard(0)),
        ],
        (4, 2): [(Shard(0), Shard(0)), (_StridedShard(0, split_factor=2), Shard(0)), (Shard(1), Replicate())],
    }[mesh_shape]
    coords = [
        tuple(c)
        for c in torch.cartesian_prod(*[torch.arange(n) for n in mesh_shape]).view(-1, len(mesh_shape)).tolist()
    ]
    for placements in layouts:
        covered = torch.zeros(shape, dtype=torch.int64)
        for coord in coords:
            index = shard_indices(shape, mesh_shape, coord, placements)
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            assert tuple(len(i) for i in index) == local, (placements, coord)
            assert all(len(i) == 0 or i[0] == o for i, o in zip(index, offset)), (placements, coord)
            covered[index[0][:, None], index[1][None, :]] += 1
        copies = torch.tensor(mesh_shape)[[isinstance(p, Replicate) for p in placements]].prod()
        assert torch.equal(covered, torch.full(shape, int(copies))), placements


def test_qk_clip_bounds_every_heads_logits():
    """Head 0 exceeds the threshold: it ends at the threshold, head 1 (sharing its key head) shrinks, 2 and 3 stay."""
    model = _model()
    model.train()
    layer = model.layers["0"].attention
    seen = []
    with torch.no_grad():
        layer.q_proj.weight[:8].mul_(30.0)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))

    def logits() -> torch.Tensor:
        model(tokens)
        q, k, ctx = seen[-1]
        return _max_logits(q, k, layer.scale, ctx)

    layer.qk_observer = lambda q, k, ctx: seen.append((q.detach(), k.detach(), ctx))
    before = logits()
    threshold = (before[0] + before[1:].max()).item() / 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # QK-clip runs after any optimizer's step
    clip = QKClip.attach(model, optimizer, threshold)
    observe = layer.qk_observer
    layer.qk_observer = lambda q, k, ctx: seen.append((q.detach(), k.detach(), ctx)) or observe(q, k, ctx)
    assert torch.equal(logits(), before)
    torch.testing.assert_close(clip.seen["layers.0.attention"], before)
    optimizer.step()  # no gradients: only the clip acts
    assert clip.metrics()["max_logit/layers.0.attention"] == pytest.approx(before.max().item())
    after = logits()
    torch.testing.assert_close(after[0], torch.tensor(threshold), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[1], before[1] * (threshold / before[0]).sqrt(), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[2:], before[2:], rtol=1e-6, atol=0)


def _max_logits(q, k, scale, ctx) -> torch.Tensor:
    """Eager reference: the masked pre-softmax logits' maximum per head."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.mT) * scale
    return scores.masked_fill(~_allowed(ctx, q.shape[2], k.shape[2], q.device), float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optim.qk_clip_threshold=50", "model.attention.qk_norm=true"], "qk_norm would undo"),
        (["optim.qk_clip_threshold=50", "model.attention.kernel=linear"], "needs softmax attention logits"),
        (["optim.muon_ns_steps=0"], r"optim.muon.ns_steps must be in \[1, 99\]"),
        (["optim.muon_momentum=1.0"], r"optim.muon.momentum must be in \[0, 1\)"),
        (["optim.name=lion"], "optim.name"),
        (["optim.name=muon", "parallel.engine=deepspeed"], "optim.name='muon' needs parallel.engine='torch'"),
        (["optim.state_dtype=bf16", "parallel.engine=deepspeed"], "optim.state_dtype='bf16' needs parallel.engine"),
        (["optim.qk_clip_threshold=5", "parallel.engine=deepspeed"], "qk_clip_threshold needs parallel.engine"),
    ],
)
def test_optimizer_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_muon_resumes_exactly_and_refuses_another_optimizer(tiny_config, tmp_path):
    muon = ["optim.name=muon", "optim.schedule=constant", "optim.qk_clip_threshold=0.1", "train.eval_every=0"]
    full = train(tiny_config(*muon, "train.steps=4", run_dir=tmp_path / "full"))
    train(tiny_config(*muon, "train.steps=2", "checkpoint.every=2", run_dir=tmp_path / "half"))
    resumed = train(tiny_config(*muon, "train.steps=4", run_dir=tmp_path / "half"))
    assert resumed.losses == full.losses[2:]  # momentum buffers restored from DCP: bitwise the same run
    with pytest.raises(
        CheckpointError,
        match=r"^checkpoint '.*' was trained with optim.name=muon, not adamw; its optimizer state holds muon's "
        r"buffers: resume with optim.name=muon or start a new train.run_dir$",
    ):
        train(tiny_config("train.steps=6", "optim.schedule=constant", run_dir=tmp_path / "half"))
