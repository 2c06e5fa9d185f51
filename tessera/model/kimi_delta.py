"""Kimi Delta Attention (KDA, Kimi Linear 2025): the gated delta rule with a decay per key channel.

Each head keeps a (head_dim x head_dim) state ``S`` updated by

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

where Gated DeltaNet's one decay per head becomes a vector ``g_t`` (head_dim) per head: a low-rank projection
``f_b(f_a(x))`` plus ``dt_bias``, through ``-exp(A_log) * softplus``. The write strength is ``beta =
sigmoid(b_proj(x))``; the output is normalized per head and gated by ``sigmoid(g_b(g_a(x)))``.

Everything else - the causal convolution on q, k, v, the L2 norms, the chunked (WY / UT) and recurrent forms,
the state cache, document resets and the context-parallel split - is :class:`DeltaRuleMixer`'s, shared with
Gated DeltaNet; the chunked form's products take the per-channel decay block by block
(:func:`~tessera.model.gated_deltanet.decayed_products`).

Parameter names and shapes follow the Kimi Linear checkpoints (what HF transformers' ``KimiLinearDeltaAttention``
saves: its forget gate's ``f_a_proj``, ``f_b_proj``, ``dt_bias`` and ``A_log`` one level up, three convolutions
``q_conv1d``, ``k_conv1d``, ``v_conv1d``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig
from tessera.config.checks import require_all
from tessera.model.gated_deltanet import DeltaRuleMixer, GatedOutputNorm, delta_rule_flops, register_delta_rule_mixer
from tessera.model.mamba import _inverse_softplus_dt


class KimiDeltaAttention(DeltaRuleMixer):
    """The Kimi Delta Attention token mixer of ``[model.kda]``: (B, T, dim) -> (B, T, dim)."""

    title = "Kimi Delta Attention"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        kda = cfg.kda
        heads, head_dim = kda.heads, kda.head_dim
        width = heads * head_dim
        self.key_head_dim = self.value_head_dim = head_dim
        self.chunk, self.group, self.state_heads = kda.chunk, 1, heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(cfg.dim, width, bias=False) for _ in range(3))
        self.conv_dim = 3 * width
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, kda.conv, groups=width, padding=kda.conv - 1, bias=False) for _ in range(3)
        )
        self.f_a_proj = nn.Linear(cfg.dim, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))  # HF's shape: broadcast over (B, T, H, Dk)
        self.b_proj = nn.Linear(cfg.dim, heads, bias=False)
        self.g_a_proj = nn.Linear(cfg.dim, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = GatedOutputNorm(head_dim, cfg.norm_eps, gate="sigmoid")
        self.o_proj = nn.Linear(width, cfg.dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A ~ U(1, 16) (log-stored); dt_bias the inverse softplus of a log-uniform step in [1e-3, 0.1] (HF's)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            self.dt_bias.copy_(_inverse_softplus_dt(self.dt_bias.shape[0], self.dt_bias.device))

    def conv_weight(self) -> torch.Tensor:
        """Three convolutions (HF's q_conv1d, k_conv1d, v_conv1d) as one over [q | k | v]."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x), x

    def _gates(self, x: torch.Tensor, extras: object) -> tuple[torch.Tensor, torch.Tensor]:
        """A log decay per key channel ``-exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`` (B, H, T, Dk) and
        ``beta = sigmoid(b_proj(x))`` (B, H, T)."""
        batch, length = x.shape[:2]
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(batch, length, -1, self.key_head_dim)
        g = -self.A_log.float().exp().view(-1, 1) * F.softplus(f)
        return g.transpose(1, 2), self.b_proj(x).float().sigmoid().transpose(1, 2)

    def _output(self, y: torch.Tensor, extras: object) -> torch.Tensor:
        """Each head normalized and gated by ``sigmoid(g_b(g_a(x)))``, then ``o_proj``."""
        gate = self.g_b_proj(self.g_a_proj(extras)).view_as(y)
        return self.o_proj(self.o_norm(y, gate).flatten(2))


def check_kimi_delta(m: ModelConfig) -> None:
    """[model.kda]: positive widths."""
    require_all("model.kda", m.kda, ("heads", "head_dim", "conv", "chunk"), positive=True)


def _flops(cfg: ModelConfig, seq_len: int) -> float:
    """As Gated DeltaNet's (:func:`delta_rule_flops`) with one head width for keys and values; the per-channel
    decay adds elementwise work only."""
    kda = cfg.kda
    return delta_rule_flops(kda.heads, kda.head_dim, kda.head_dim, min(kda.chunk, seq_len))


# Whole heads per rank; the decay and gate projections' low-rank halves (dim -> head_dim) are split and gathered.
KIMI_DELTA = register_delta_rule_mixer(
    "kimi_delta",
    "K",
    "kda",
    KimiDeltaAttention,
    (check_kimi_delta,),
    _flops,
    {
        **{name: "colwise" for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_b_proj")},
        "f_a_proj": "colwise_gathered",
        "g_a_proj": "colwise_gathered",
        "o_proj": "rowwise",
    },
)
