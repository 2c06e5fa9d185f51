"""The attention kernels, one file each; each registers a :class:`tessera.registry.KernelSpec`.

Adding a kernel: a new file here that registers its spec, and one name in the import line below
(the registry line; its order is the compatibility table's).
"""

from tessera.model.kernels import sdpa, eager, sparse, linear, chunked  # noqa: F401  (the registry line)
