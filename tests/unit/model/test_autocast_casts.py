"""Under autocast, the input of the q/k/v projections (and of gate/up) is cast once, not once per projection:
the forward is the same bits, the gradients the same within bf16 rounding."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config import model_config
from tessera.model.attention import Attention, AttnContext
from tessera.model.ffn import FeedForward


class _Casts(TorchDispatchMode):
    """Counts the dtype conversions of tensors shaped like ``shape``."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].shape == self.shape:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _casts_and_grad(module: torch.nn.Module, x: torch.Tensor, run) -> tuple[int, torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    counter = _Casts(x.shape)
    with torch.autocast("cpu", dtype=torch.bfloat16), counter:
        out = run(module, x * 1.0)  # not a leaf, as in a model (autocast caches the casts of leaves)
    out.float().square().sum().backward()
    return counter.count, out.detach(), x.grad


def _reference(module: torch.nn.Module, x: torch.Tensor, run) -> tuple[torch.Tensor, torch.Tensor]:
    """The same forward with each projection casting its own input (the dtypes hook switched off)."""
    import tessera.model.attention as attention
    import tessera.model.ffn as ffn

    saved = attention.autocast_input, ffn.autocast_input
    attention.autocast_input = ffn.autocast_input = lambda t: t
    try:
        _, out, grad = _casts_and_grad(module, x, run)
    finally:
        attention.autocast_input, ffn.autocast_input = saved
    return out, grad


def test_projections_read_one_cast_of_their_input():
    torch.manual_seed(0)
    cfg = model_config(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    cases = [
        (Attention(cfg), lambda m, x: m(x, AttnContext(is_causal=True))),
        (FeedForward(32, 64, "swiglu"), lambda m, x: m(x)),
    ]
    x = torch.randn(2, 16, 32)
    for module, run in cases:
        casts, out, grad = _casts_and_grad(module, x, run)
        assert casts == 1, f"{type(module).__name__}: {casts} casts of its input"
        ref_out, ref_grad = _reference(module, x, run)
        assert torch.equal(out, ref_out)
        torch.testing.assert_close(grad, ref_grad, rtol=2e-2, atol=2e-2)
