"""Nemotron-H's options against the HF modules they come from (fp32, outputs and gradients): the squared-ReLU FFN
(``model.activation = "relu2"``) against NemotronHMLP, the Mamba-2 time-step floor (``[model.mamba].dt_min``) against
NemotronHMamba2Mixer, and the ``m`` letter (a Mamba layer without a FFN) against a pair of NemotronH blocks."""

from __future__ import annotations

import torch
import transformers
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nh

from tessera.config import model_config
from tessera.model import build_model
from tessera.model.ffn import FeedForward
from tessera.model.mamba import Mamba2Mixer

TOL = 1e-5
_MAMBA = dict(version=2, state=8, head_dim=8, groups=2, chunk=8, expand=2)


def _hf_config(**kw) -> transformers.NemotronHConfig:
    args = dict(hidden_size=32, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8)
    args.update(n_groups=2, chunk_size=8, layers_block_type=["linear_attention", "mlp"])
    args.update(kw)
    return transformers.NemotronHConfig(**args)


def _spread(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                p.copy_(2 * torch.rand(p.shape, generator=gen))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) - 1)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max().item() <= TOL * scale, f"max diff {(a - b).abs().max().item():.2e}"


def _grads(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = module(x)
    out.pow(2).sum().backward()
    return out, x.grad, {n: p.grad for n, p in module.named_parameters()}


def _compare(hf: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor) -> None:
    want, want_dx, want_dw = _grads(hf, x)
    got, got_dx, got_dw = _grads(ours, x)
    _close(got, want)
    _close(got_dx, want_dx)
    for name, grad in want_dw.items():
        _close(got_dw[name], grad)


def test_squared_relu_ffn_matches_nemotron_h_mlp():
    hf = hf_nh.NemotronHMLP(_hf_config(mlp_bias=True))
    _spread(hf, 0)
    ours = FeedForward(32, 48, "relu2", bias=True)
    ours.load_state_dict(hf.state_dict())
    _compare(hf, ours, torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(1)))


def _mixers(dt_min: float) -> tuple[torch.nn.Module, Mamba2Mixer]:
    hf = hf_nh.NemotronHMamba2Mixer(_hf_config(time_step_min=0.3), layer_idx=0).eval()  # eval: HF's torch path
    _spread(hf, 2)
    ours = Mamba2Mixer(model_config(dim=32, norm_eps=1e-5, mamba={**_MAMBA, "dt_min": dt_min}))
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_time_step_floor_matches_nemotron_h_mamba2_mixer():
    """softplus(dt + dt_bias) is floored at time_step_min = 0.3 (about half of these time steps fall below it)."""
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(3))  # 21: a partial last chunk
    hf, ours = _mixers(dt_min=0.3)
    _compare(hf, ours, x)
    hf, unfloored = _mixers(dt_min=0.0)
    with torch.no_grad():
        assert (unfloored(x) - hf(x)).abs().max().item() > 1e-2  # the floor changes these numbers


def test_mamba_layer_alone_has_no_ffn_and_matches_two_nemotron_h_blocks():
    """Pattern "Mm": a Mamba-2 + FFN block, then a Mamba-2 block alone = NemotronH's M, -, M layers."""
    cfg = model_config(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        layer_pattern="Mm",
        activation="relu2",
        ffn_hidden=48,
        norm_eps=1e-5,
        position={"kind": "none"},
        mamba={**_MAMBA, "ffn": True},
    )
    ours = build_model(cfg).eval()
    assert ours.layers["0"].feed_forward is not None and ours.layers["1"].feed_forward is None
    assert ours.layers["1"].ffn_norm is None
    hf_cfg = _hf_config(layers_block_type=["linear_attention", "mlp", "linear_attention"], time_step_min=0.0)
    blocks = torch.nn.ModuleList(hf_nh.NemotronHBlock(hf_cfg, i) for i in range(3)).eval()
    _spread(blocks, 4)
    names = {"0.norm": "layers.0.mamba_norm", "0.mixer": "layers.0.mamba", "1.norm": "layers.0.ffn_norm"}
    names.update({"1.mixer": "layers.0.feed_forward", "2.norm": "layers.1.mamba_norm", "2.mixer": "layers.1.mamba"})
    state = {}
    for key, value in blocks.state_dict().items():
        prefix = next(p for p in names if key.startswith(p + "."))
        state[names[prefix] + key[len(prefix) :]] = value
    missing = ours.load_state_dict(state, strict=False).missing_keys
    assert all(not k.startswith("layers.") for k in missing)  # every block weight came from HF's three layers

    def hf_stack(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = block(h)
        return h

    def our_stack(h: torch.Tensor) -> torch.Tensor:
        ctx = ours.context(h.shape[0], h.shape[1], 0, None, None, h.device)
        for i in range(2):
            h = ours.layers[str(i)](h, ctx)
        return h

    x = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _close(our_stack(x), hf_stack(x))
