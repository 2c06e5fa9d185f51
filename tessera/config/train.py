"""[train]: the training loop; [train.distill]: distilling a teacher's logits into the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DistillConfig:
    """[train.distill]: knowledge distillation from a teacher model (teacher = "" keeps it off)."""

    teacher: str = ""  # an HF model dir or a tessera run/checkpoint, same vocabulary: distill its logits ("" = off)
    temperature: float = 2.0  # both models' logits are divided by this before the softmax
    alpha: float = 0.5  # loss = (1 - alpha) * cross-entropy + alpha * T^2 * KL(teacher||student)


@dataclass
class TrainConfig:
    """The training loop: length, batch, precision, evaluation, where outputs go."""

    run_dir: str = "runs/default"  # where config, checkpoints, metrics and plots go
    steps: int = 1000  # optimizer steps to train
    batch_size: int = 8  # sequences per micro-batch, over all data-parallel ranks together
    grad_accum: int = 1  # micro-batches accumulated per optimizer step
    seq_len: int = 256  # tokens per training sequence
    seed: int = 1234  # seeds weights, data order and sampling
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # compute precision: autocast (or FSDP mixed precision)
    device: str = "auto"  # auto | cpu | cuda
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    eval_every: int = 100  # 0 disables periodic evaluation (a final one still runs)
    eval_batches: int = 8  # global batches of the validation split per evaluation
    resume: str = "auto"  # auto | none | path to a checkpoint directory
    init_from: str = ""  # weights only from an HF model dir, tessera run/checkpoint or DeepSpeed checkpoint ("" = off)
    upcycle_noise: float = 0.0  # upcycling init_from: each expert = dense FFN * (1 + noise * N(0, 1)); 0 = exact copies
    sample_prompt: str = "def "  # prompt of the sample generated at the end of training
    sample_tokens: int = 64  # tokens generated at the end of training; 0 disables
    threads: int = 0  # torch threads per process; 0 = $OMP_NUM_THREADS, else cores / local processes
    overwrite: bool = False  # delete an existing run's outputs in run_dir and start fresh (never written as true)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # NaN/inf loss or grad norm: stop before the update, or skip it
    max_nonfinite_skips: int = 5  # on_nonfinite=skip: stop after this many skipped steps in a row
    hang_timeout_s: float = 1800.0  # no step, eval or save completes this long: dump stacks to RUN/hang/, exit; 0 off
    on_spike: Literal["off", "warn", "rollback"] = "off"  # loss/grad-norm spike: log it, or restore + skip its data
    spike_window: int = 50  # on_spike: steps in the robust window (median + k * MAD) a step is judged against
    spike_threshold: float = 6.0  # on_spike: k, the robust standard deviations above the median that make a spike
    max_rollbacks: int = 3  # on_spike=rollback: stop (exit 2) when more rollbacks than this are needed
    elastic_world: int = 0  # processes the batch is set for; fewer (elastic restart) raise grad_accum to keep it; 0 off
    fused_loss: bool = True  # head + cross-entropy in chunks: no whole (tokens x vocab) logits (torch engine)
    loss_chunk_tokens: int = 0  # tokens per chunk of the fused head + loss; 0 = 64 MiB of fp32 logits per chunk
    mtp_loss_weight: float = 0.3  # with model.mtp_depth: the loss adds this times the mean of the depths' losses
    fp8: Literal["off", "tensorwise", "rowwise", "mxfp8"] = "off"  # torchao fp8 training of block linears; CPU emulates
    qat: Literal["none", "int8-weight", "int4-weight"] = "none"  # torchao fake-quantized block linears (QAT)
    qat_start: int = 0  # train.qat: steps trained before fake quantization is switched on (0 = from the start)
    qat_group_size: int = 32  # train.qat=int4-weight: input columns per scale (as convert quantize --group-size)
    distill: DistillConfig = field(default_factory=DistillConfig)
