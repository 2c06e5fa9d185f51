"""Looking inside a trained model: attention maps, head importance and pruning, MHA -> GQA conversion.

Tools over :mod:`tessera.model` (never imported by it): they read a run or an HF directory, and the
ones that change a model write a new run that ``tessera train`` continues.

- :mod:`tessera.analysis.capture`: attention weights of a forward pass, recomputed exactly (eager
  softmax, or a linear kernel's implicit weights) and handed to a callback, never kept on modules.
- :mod:`tessera.analysis.inspect`: ``tessera inspect attention`` (heatmaps and per-head statistics).
- :mod:`tessera.analysis.importance`: per-head entropy and gradient importance on the validation split.
- :mod:`tessera.analysis.prune`: ``tessera prune heads`` (global or layer by layer).
- :mod:`tessera.analysis.gqa`: ``tessera convert gqa`` (mean-pooled KV heads, Ainslie et al. 2023).
"""
