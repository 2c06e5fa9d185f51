"""The ``chunked`` kernel (tessera/model/kernels/chunked.py), added through the registry as one file and
one registry line: the eager kernel's outputs and gradients (fp32, 1e-5) for every mask it is handed,
with GQA and lengths that are not a multiple of its query block; a whole model gives eager's loss and
parameter gradients; and the probabilities of a long sequence are never all held at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import model_config
from tessera.model import build_model
from tessera.model.attention import AttnContext
from tessera.model.kernels import chunked
from tessera.model.kernels.eager import eager_attend

CPU = torch.device("cpu")
LAYER = SimpleNamespace(scale=0.3, weights_observer=None)


def _contexts(q_len: int, kv_len: int) -> dict[str, AttnContext]:
    gen = torch.Generator().manual_seed(4)
    docs = torch.randint(0, 3, (2, kv_len), generator=gen).sort(dim=1).values
    same_doc = (docs[:, None, -q_len:, None] == docs[:, None, None, :]).expand(2, 1, q_len, kv_len)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    bias = torch.randn(1, 4, q_len, kv_len, generator=gen)
    return {
        "full": AttnContext(),
        "causal": AttnContext(is_causal=True, causal=True),
        "documents": AttnContext(mask=same_doc & causal, causal=True),
        "bias": AttnContext(bias=bias, is_causal=True, causal=True),
    }


def _run(fn, q, k, v, ctx) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    out = fn(LAYER, q, k, v, ctx, 0.0)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    return out, torch.autograd.grad((out * weights).sum(), (q, k, v))


@pytest.mark.parametrize("q_len, kv_len", [(300, 300), (45, 45), (70, 200)])  # 200: queries after a cache
@pytest.mark.parametrize("name", ["full", "causal", "documents", "bias"])
def test_chunked_equals_eager_outputs_and_gradients(name, q_len, kv_len):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, q_len, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, kv_len, 8, generator=gen, requires_grad=True) for _ in range(2))
    ctx = _contexts(q_len, kv_len)[name]
    want, want_grads = _run(eager_attend, q, k, v, ctx)
    got, got_grads = _run(chunked.chunked_attend, q, k, v, ctx)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_a_model_on_the_chunked_kernel_gives_eager_losses_and_gradients(position, monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 16)  # several blocks in a tiny model
    cfg = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.2)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    docs = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    losses, grads = [], []
    for kernel in ("eager", "chunked"):
        torch.manual_seed(0)
        model = build_model(model_config(**cfg, attention={"kernel": kernel}, position={"kind": position}))
        loss = model(tokens, document_ids=docs).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for name, g in grads[1].items():
        torch.testing.assert_close(g, grads[0][name], rtol=0, atol=1e-5)


class _Largest(TorchDispatchMode):
    """The largest tensor any op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_holds_all_the_scores_of_a_long_sequence():
    length, heads = 1024, 2
    q, k, v = (torch.randn(1, heads, length, 8, requires_grad=True) for _ in range(3))
    ctx = AttnContext(is_causal=True, causal=True)
    with _Largest() as largest:
        out = chunked.chunked_attend(LAYER, q, k, v, ctx, 0.0)
        out.sum().backward()
    assert largest.numel <= heads * chunked.QUERY_BLOCK * length  # one block of scores, not heads * length^2
    with _Largest() as eager:
        eager_attend(LAYER, q, k, v, ctx, 0.0).sum().backward()
    assert eager.numel >= heads * length * length  # the reference holds them all
