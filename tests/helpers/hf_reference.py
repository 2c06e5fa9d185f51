"""Tiny HF checkpoints saved with save_pretrained, and the plain transformers + AdamW loop the init_from tests
compare tessera against (the same weights, the same batches, the same schedule)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,  # far from uniform predictions: a misplaced block changes the loss visibly
}


def save_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A random LlamaForCausalLM of the tiny shape, saved with save_pretrained (safetensors) into ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": False, **overrides})
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def save_mixtral(path: Path, seed: int = 0) -> Path:
    """A random MixtralForCausalLM (4 experts, top-2) of the tiny shape, saved into ``path``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**TINY_LLAMA, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(str(path))
    return path


def lr_factor(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_ratio`` (tessera's default schedule, written out)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def distill_reference(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hinton et al.'s KL(softmax(teacher / T) || softmax(student / T)), summed over the vocabulary and
    averaged over positions, written out with probabilities (not tessera's log-space code)."""
    p = F.softmax(teacher.double() / temperature, dim=-1)
    q = F.softmax(student.double() / temperature, dim=-1)
    return (p * (p.log() - q.log())).sum(-1).mean()


def transformers_loop(
    hf_dir: Path,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    optim,
    teacher: tuple[Path, float, float] | None = None,
    kls: list[float] | None = None,
) -> tuple[list, list]:
    """Per-step (loss, grad norm) of AutoModelForCausalLM trained with torch.optim.AdamW on ``batches``
    ((inputs, labels) per step); weight decay on matrices except the embedding, global-norm clipping.
    ``teacher`` = (HF dir, temperature, alpha): distil that model's logits (each step's KL appended to ``kls``)."""
    from transformers import AutoModelForCausalLM

    frozen = None
    if teacher is not None:
        frozen = AutoModelForCausalLM.from_pretrained(str(teacher[0]), dtype=torch.float32).eval()

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.train()
    embedding = model.get_input_embeddings().weight
    decay = [p for p in model.parameters() if p.ndim >= 2 and p is not embedding]
    no_decay = [p for p in model.parameters() if p.ndim < 2 or p is embedding]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        foreach=False,
    )
    steps = len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, optim.warmup_steps, steps, optim.min_lr_ratio)
    )
    losses, norms = [], []
    for inputs, labels in batches:
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        if frozen is not None:
            _, temperature, alpha = teacher
            with torch.no_grad():
                teacher_logits = frozen(input_ids=inputs).logits
            kl = distill_reference(logits, teacher_logits, temperature).float()
            kls.append(kl.item())
            loss = (1 - alpha) * loss + alpha * temperature**2 * kl
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms
