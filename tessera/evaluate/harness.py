"""tessera models inside lm-eval-harness: the ``tessera`` model adapter and the task runner.

The adapter (:class:`TesseraLM`) wraps a :class:`~tessera.evaluate.scoring.Scorer`: in the training loop over
the live model, its tokenizer and the data-parallel reduction; from the command line
(:mod:`tessera.lm_eval_model`, registered as ``tessera``) over a run, checkpoint or HF directory. lm-eval builds
the requests, applies the task's templates and computes the metrics; tessera only scores tokens. lm-eval sees one
process (rank 0 of 1) on every rank; the sharding is inside the scorer, so every rank gets the same metrics.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tessera.config import ConfigError
from tessera.evaluate.scoring import Scorer


def require_lm_eval() -> None:
    """ConfigError naming the extra when lm-eval is not installed."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("downstream evaluation needs lm-eval-harness: pip install 'tessera[eval]'")


require_lm_eval()

from lm_eval.api.model import TemplateLM  # noqa: E402 (after the one-line check for the missing extra)


class TesseraLM(TemplateLM):
    """lm-eval's view of a tessera decoder: log-likelihoods and greedy generation through a :class:`Scorer`.

    The command-line adapter (``--model tessera``, :mod:`tessera.lm_eval_model`) is this class loading a run."""

    def __init__(self, scorer: Scorer, tokenizer: Any) -> None:
        super().__init__()
        self.scorer, self.tok = scorer, tokenizer

    @property
    def eot_token_id(self) -> int:
        """The end-of-document token (tessera's document separator)."""
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """BOS when the tokenizer has one, else EOS: what an empty context is conditioned on."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` (no special tokens)."""
        return self.tok.encode(string)

    def _loglikelihood_tokens(self, requests: list, **kwargs: Any) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihoods([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, in windows of the model's context, each conditioned on its past."""
        pairs, owner = [], []
        for n, request in enumerate(requests):
            ids = self.tok_encode(request.args[0])
            window = self.scorer.max_len
            for start in range(0, len(ids), window):
                context = ids[max(0, start - window) : start] or [self.prefix_token_id]
                pairs.append((context, ids[start : start + window]))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self.scorer.loglikelihoods(pairs)):
            totals[n] += logprob
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first of each request's ``until`` strings."""
        prompts = [self.tok_encode(r.args[0]) or [self.prefix_token_id] for r in requests]
        kwargs = [dict(r.args[1]) for r in requests]
        max_new = max(int(k.get("max_gen_toks", 64)) for k in kwargs) if kwargs else 0
        outs = self.scorer.greedy(prompts, max_new, self.tok.eos_id)
        texts = []
        for prompt, out, k in zip(prompts, outs, kwargs):
            # Decoded after the prompt, not alone: SentencePiece drops a leading space of a text decoded alone.
            head = self.tok.decode(prompt)
            text = self.tok.decode(prompt + out[: int(k.get("max_gen_toks", 64))])
            text = text[len(head) :] if text.startswith(head) else self.tok.decode(out)
            until = k.get("until") or []
            for stop in [until] if isinstance(until, str) else until:
                text = text.split(stop)[0] if stop else text
            texts.append(text)
        return texts


def run_tasks(
    lm: TesseraLM, tasks: list[str], task_dirs: list[Path], limit: int = 0, include_defaults: bool = True
) -> dict[str, float]:
    """Each task's metrics (``{task}/{metric}``, stderr left out) with lm-eval's own evaluation loop."""
    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=task_manager(task_dirs, include_defaults=include_defaults),
        limit=limit or None,
        log_samples=False,
        verbosity="WARNING",
        bootstrap_iters=0,
    )
    flat: dict[str, float] = {}
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            name = key.split(",")[0]
            if isinstance(value, (int, float)) and "stderr" not in name and name != "sample_len":
                flat[f"{task}/{name}"] = float(value)
    return flat


def task_manager(task_dirs: list[Path], include_defaults: bool = True) -> Any:
    """lm-eval's TaskManager over ``task_dirs`` (and lm-eval's own tasks unless ``include_defaults`` is false:
    indexing those thousands of YAMLs takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(d) for d in task_dirs] or None, include_defaults=include_defaults)
