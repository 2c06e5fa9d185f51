"""ParallelDims: the parallel degrees of a job, checked against the world size, and its mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.config import ParallelConfig
from tessera.layout import check_expert_degree, data_parallel_degree, resolve_dp_shard


@dataclass
class ParallelDims:
    """Degrees of data (replicate x shard), context, tensor, pipeline and expert parallelism.

    ``dp_shard = -1`` takes whatever the world size leaves. The mesh is built once, lazily, with
    dimensions ``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 ones omitted) and named
    flattened views: ``dp`` (batch sharding: replicate x shard), ``fsdp`` (parameter
    sharding: shard x cp) and, with cp, ``dp_cp`` (the ranks whose losses make up one global
    batch: replicate x shard x cp). Expert parallelism (as torchtitan) carves ``ep`` out of
    ``dp_shard x cp x tp``: dp_shard splits into ``(efsdp, dp_shard_in_ep)`` and
    ``ep = dp_shard_in_ep x cp x tp``; the experts are then FSDP-sharded over ``efsdp`` (with
    dp_replicate: ``ehsdp``), the rest of the model as without ep. The ranks keep their
    places, so data loading and dense sharding are unchanged.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _named: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.dp_shard = resolve_dp_shard(self, self.world_size)
        if self.ep > 1:
            check_expert_degree(self.ep, self.dp_shard, self.cp, self.tp)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Degrees from the config's ``[parallel]`` section for ``world_size`` processes."""
        return cls(cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return data_parallel_degree(self)

    @property
    def efsdp(self) -> int:
        """Ranks that shard each expert (expert-FSDP): the data-parallel shards left over by ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def _mesh_dims(self) -> list[tuple[str, int]]:
        """(name, size) of the mesh dimensions, outermost first; dp_shard splits in two with ep."""
        shard = [("dp_shard", self.dp_shard)]
        if self.ep > 1:  # ep = dp_shard_in_ep x cp x tp, so dp_shard = efsdp x dp_shard_in_ep
            shard = [("efsdp", self.efsdp), ("dp_shard_in_ep", self.ep // (self.cp * self.tp))]
        return [("pp", self.pp), ("dp_replicate", self.dp_replicate), *shard, ("cp", self.cp), ("tp", self.tp)]

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's DeviceMesh (built once); call after the process group exists."""
        if self._mesh is not None:
            return self._mesh
        # Size-1 dimensions are left out, except the shard dimension of data parallelism beside TP/PP
        # (FSDP2 replicates on a (replicate, shard=1) mesh) and efsdp (experts are FSDP-wrapped even over one rank).
        shard_dim = "efsdp" if self.ep > 1 else "dp_shard"
        beside = {shard_dim} if self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1) else set()
        dims = [(n, d) for n, d in self._mesh_dims() if d > 1 or n in beside or n == "efsdp"]
        names = tuple(n for n, _ in dims) or ("dp_shard",)
        sizes = tuple(d for _, d in dims) or (1,)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        self._named = {name: mesh[name] for name in names if name in ("pp", "tp", "cp")}
        real = {n for n, d in dims if d > 1}
        viewable = real | beside
        shard_dims = ("efsdp", "dp_shard_in_ep") if self.ep > 1 else ("dp_shard",)
        self._add_view(mesh, "dp", tuple(n for n in ("dp_replicate", *shard_dims) if n in viewable))
        shard = tuple(n for n in (*shard_dims, "cp") if n in viewable)
        if self._add_view(mesh, "fsdp", shard) and "dp_replicate" in names:
            # HSDP: replicate across the first dim, shard across the second
            self._named["hsdp"] = mesh[("dp_replicate", "fsdp" if len(shard) > 1 else shard[0])]
        if self.ep > 1:
            self._add_view(mesh, "ep", tuple(n for n in ("dp_shard_in_ep", "cp", "tp") if n in real))
            self._named["efsdp"] = mesh["efsdp"]
            if "dp_replicate" in names:
                self._named["ehsdp"] = mesh[("dp_replicate", "efsdp")]
        if "cp" in real and "dp_replicate" not in names:  # the loss mesh is the fsdp view itself
            self._named["dp_cp"] = self._named["fsdp"]
        elif "cp" in real:
            self._add_view(mesh, "dp_cp", tuple(n for n in ("dp_replicate", *shard_dims, "cp") if n in viewable))
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh | None:
        """The whole mesh (None before :meth:`build_mesh`)."""
        return self._mesh

    def _add_view(self, mesh: DeviceMesh, name: str, dims: tuple[str, ...]) -> bool:
        """Name the (flattened) view of ``dims`` as ``name``; False when there is none."""
        if dims:
            self._named[name] = mesh[dims]._flatten(name) if len(dims) > 1 else mesh[dims[0]]
        return bool(dims)

    def submesh(self, name: str) -> DeviceMesh | None:
        """A named sub-mesh ("dp", "fsdp", "hsdp", "tp", "cp", "pp", with cp "dp_cp", and with ep > 1 "ep",
        "efsdp", "ehsdp"); None when trivial or before ``build_mesh``."""
        return self._named.get(name)
