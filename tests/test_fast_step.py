"""The fast training step: the fused chunked head + loss equals the plain loss, a step reads the
device once, and parallel.compile="auto" compiles on CUDA only (bools still load).

Speed itself is measured in benchmarks/ (throughput.py, memory_head.py), never asserted here.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_runs_match, torchrun
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.validate import load_config
from tessera.parallel.activation import compile_enabled
from tessera.train.loss import IGNORE_INDEX, linear_cross_entropy, lm_loss
from tessera.train.trainer import Trainer, train

aten = torch.ops.aten


def _case(bias: bool, masked: bool, ignored: bool, generator: torch.Generator):
    b, t, d, v = 3, 7, 16, 50
    hidden = torch.randn(b, t, d, generator=generator, requires_grad=True)
    weight = torch.randn(v, d, generator=generator, requires_grad=True)
    bias_t = torch.randn(v, generator=generator, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (b, t), generator=generator)
    if ignored:
        labels[0, :3] = IGNORE_INDEX
    mask = torch.rand(b, t, generator=generator) > 0.3 if masked else None
    if mask is not None and ignored:
        mask &= labels != IGNORE_INDEX
    return hidden, weight, bias_t, labels, mask


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    """Within ``rtol`` of the reference's largest magnitude (elementwise ratios blow up near zero)."""
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item(), f"{what}: max error {err:.2e} vs scale {want.abs().max().item():.2e}"


def test_fused_head_loss_equals_lm_loss_on_full_logits():
    gen = torch.Generator().manual_seed(0)
    for bias, masked, ignored, smoothing, chunk in [
        (False, False, False, 0.0, 4),
        (True, False, False, 0.1, 5),
        (False, True, False, 0.1, 1),
        (True, True, True, 0.0, 0),
        (False, False, True, 0.2, 64),
    ]:
        hidden, weight, bias_t, labels, mask = _case(bias, masked, ignored, gen)
        inputs = [hidden, weight] + ([bias_t] if bias else [])
        want = lm_loss(F.linear(hidden, weight, bias_t), labels, smoothing, mask)
        want_grads = torch.autograd.grad(want * 3.0, inputs)  # an upstream gradient other than 1
        got = linear_cross_entropy(hidden, weight, bias_t, labels, mask, smoothing, chunk)
        got_grads = torch.autograd.grad(got * 3.0, inputs)
        where = f"bias={bias} masked={masked} ignored={ignored} smoothing={smoothing} chunk={chunk}"
        _assert_close(got, want, f"{where} loss")
        for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
            _assert_close(g, w, f"{where} grad of {name}")


def test_fused_head_loss_backward_can_run_twice_for_a_split_backward():
    """The zero-bubble pipeline schedules take the input gradients in one backward pass and the weight
    gradients in a second one through the same graph: with ``backward_twice`` both equal one pass's."""
    hidden, weight, bias, labels, mask = _case(True, True, False, torch.Generator().manual_seed(1))
    want = torch.autograd.grad(lm_loss(F.linear(hidden, weight, bias), labels, 0.1, mask) * 2.0, [hidden, weight, bias])
    loss = linear_cross_entropy(hidden, weight, bias, labels, mask, 0.1, 3, backward_twice=True) * 2.0
    (grad_hidden,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    grad_weight, grad_bias = torch.autograd.grad(loss, [weight, bias])
    for name, got, ref in zip(("hidden", "weight", "bias"), (grad_hidden, grad_weight, grad_bias), want):
        _assert_close(got, ref, f"second pass: grad of {name}")
    once = linear_cross_entropy(hidden, weight, bias, labels, mask, 0.1, 3) * 2.0
    torch.autograd.grad(once, [hidden], retain_graph=True)
    with pytest.raises(TypeError):  # without it the first pass frees the stored gradients
        torch.autograd.grad(once, [weight])


def test_fused_head_loss_under_bf16_autocast_keeps_the_head_in_bf16_and_the_softmax_in_fp32():
    gen = torch.Generator().manual_seed(1)
    hidden, weight, _, labels, _ = _case(False, False, False, gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = lm_loss(F.linear(hidden, weight), labels)
        got = linear_cross_entropy(hidden, weight, None, labels, chunk=4)
    want_h, want_w = torch.autograd.grad(want, [hidden, weight])
    got_h, got_w = torch.autograd.grad(got, [hidden, weight])
    assert got.dtype == torch.float32 and got_w.dtype == weight.dtype
    _assert_close(got, want, "bf16 loss")
    _assert_close(got_h, want_h, "bf16 grad of hidden", rtol=1e-2)  # bf16 matmuls on both sides
    _assert_close(got_w, want_w, "bf16 grad of weight", rtol=1e-2)  # the reference rounds its sum to bf16


def test_fused_vocab_parallel_loss_equals_loss_parallel():
    result = torchrun(2, "tests/dist_fused_loss.py")
    assert "fused vocab-parallel loss: ok" in result.stdout


def test_trainer_fused_loss_matches_the_unfused_run(tiny_config, tmp_path):
    common = (
        "train.steps=4",
        "train.eval_every=2",
        "train.label_smoothing=0.1",
        "data.document_mask=true",
        "data.mask_eod_loss=true",
        "checkpoint.enabled=false",
        "train.loss_chunk_tokens=24",
    )
    train(tiny_config(*common, "train.fused_loss=false", run_dir=tmp_path / "plain"))
    result = train(tiny_config(*common, run_dir=tmp_path / "fused"))
    assert assert_runs_match(tmp_path / "fused", tmp_path / "plain") == 4
    assert len(result.val_losses) == 3  # steps 0, 2 and 4 were evaluated through the fused loss too


class _HostReads(TorchDispatchMode):
    """Counts the ops of this thread that make the host wait for the device (on CUDA).

    Two reads seen on CPU are host-only on an accelerator and not counted: the optimizer's step
    counters (torch keeps them on the host unless ``capturable``/``fused``) and the position-range
    check, which runs on CPU tensors only (tessera/model/position.py).
    """

    HOST_ONLY = ("check_positions", "_get_value")

    SYNCING: ClassVar[set] = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING and not any(f.name in self.HOST_ONLY for f in traceback.extract_stack()):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_the_device_once(tiny_config, monkeypatch):
    trainer = Trainer(tiny_config("train.grad_accum=3", "data.document_mask=true", "train.label_smoothing=0.1"))
    try:
        # parallel.compile="auto" does not compile on CPU; the optimizer is torch's fused AdamW (optim.implementation)
        assert not trainer.compiled and not any(isinstance(m, OptimizedModule) for m in trainer.model.modules())
        assert trainer.optimizer.defaults["fused"] is True
        trainer.train_step()  # warm-up (lazy state)
        main, real_tolist = threading.current_thread(), torch.Tensor.tolist
        counter = _HostReads()

        def tolist(self):
            if threading.current_thread() is main:
                counter.reads.append("tolist")
            return real_tolist(self)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        with counter:
            metrics = trainer.train_step()
        assert counter.reads == ["tolist"], counter.reads  # loss and grad norm, read together for the guard
        assert isinstance(metrics["loss"], float) and isinstance(metrics["grad_norm"], float)
    finally:
        trainer.close()
        trainer.data.train.close()


@pytest.mark.parametrize("value", ["-1"])
def test_a_negative_loss_chunk_is_refused(tiny_config, value):
    from tessera.config import ConfigError

    with pytest.raises(ConfigError, match="train.loss_chunk_tokens must be >= 0"):
        tiny_config(f"train.loss_chunk_tokens={value}")


def test_compile_auto_is_on_cuda_only_and_true_false_still_load(tiny_config, tmp_path):
    p = tiny_config().parallel
    assert p.compile == "auto" and not compile_enabled(p, "cpu") and compile_enabled(p, "cuda")
    for refused in ({"engine": "deepspeed"}, {"pp": 2, "pp_schedule": "interleaved_zb"}):  # auto never errors
        assert not compile_enabled(dataclasses.replace(p, **refused), "cuda"), refused
    for text, want in [("true", True), ("false", False), ("False", False)]:
        p = tiny_config(f"parallel.compile={text}").parallel
        assert p.compile is want and compile_enabled(p, "cpu") is want and compile_enabled(p, "cuda") is want
    recipe = tmp_path / "old.toml"
    recipe.write_text("[parallel]\ncompile = true\n")  # recipes written before "auto" existed
    assert load_config(recipe, []).parallel.compile is True


def test_the_inductor_cache_moves_out_of_the_temp_directory_unless_the_user_chose_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from tessera.parallel.activation import use_inductor_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo sets
    assert use_inductor_cache(tmp_path / "inductor") == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_inductor_cache(tmp_path / "inductor") == str(tmp_path / "mine")
