"""Under torchrun (2 ranks): downstream-task scores equal the single-process scores at dp=2 and at tp=2.

Every rank builds the same tiny decoder (seed 0) and scores the same requests three ways: alone (the
reference), dealt over two data-parallel ranks (sums over the world), and tensor-parallel over both ranks
(DTensor plan, the model's normal forward; greedy generation too). Rank 0 writes the three results as JSON to ``argv[1]``.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from distexit import run_and_exit
from torch.distributed.device_mesh import init_device_mesh

from tessera.config import model_config
from tessera.evaluate.scoring import Scorer
from tessera.model import build_model
from tessera.parallel.tensor import apply_tensor_parallel


def _world_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _requests(vocab: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(1)
    pairs = []
    for n in range(7):  # odd: one rank has a request fewer (it repeats one, dropping the result)
        ctx = torch.randint(1, vocab, (5 + n,), generator=gen).tolist()
        pairs.append((ctx, torch.randint(1, vocab, (1 + n % 3,), generator=gen).tolist()))
    prompts = [torch.randint(1, vocab, (4 + n,), generator=gen).tolist() for n in range(5)]
    return pairs, prompts


def score(scorer: Scorer, pairs: list, prompts: list, greedy: bool) -> dict:
    out = {"loglik": [list(r) for r in scorer.loglikelihoods(pairs)]}
    if greedy:
        out["greedy"] = scorer.greedy(prompts, 6, eos_id=0)
    return out


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = model_config(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    pairs, prompts = _requests(cfg.vocab_size)
    cpu = torch.device("cpu")
    results = {"single": score(Scorer(model, cpu, 32), pairs, prompts, True)}
    dp = Scorer(model, cpu, 32, dist.get_rank(), dist.get_world_size(), _world_sum)
    results["dp2"] = score(dp, pairs, prompts, True)
    tp_model = copy.deepcopy(model)
    apply_tensor_parallel(tp_model, init_device_mesh("cpu", (2,)), False)
    results["tp2"] = score(Scorer(tp_model.eval(), cpu, 32), pairs, prompts, True)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    run_and_exit(main)
