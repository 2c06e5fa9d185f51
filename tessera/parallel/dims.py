"""ParallelDims: the parallel degrees of a job, checked against the world size, and its mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.config import ConfigError, ParallelConfig
from tessera.layout import resolve_dp_shard


@dataclass
class ParallelDims:
    """Degrees of data (replicate x shard), context, tensor, pipeline and expert parallelism.

    ``dp_shard = -1`` takes whatever the world size leaves. The mesh is built once, lazily, with
    dimensions ``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 ones omitted) and named
    flattened views: ``dp`` (batch sharding: replicate x shard) and ``fsdp`` (parameter
    sharding: shard x cp).
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
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp}")

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        """Degrees from the config's ``[parallel]`` section for ``world_size`` processes."""
        return cls(cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's DeviceMesh (built once); call after the process group exists."""
        if self._mesh is not None:
            return self._mesh
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        # Data parallelism beside TP/PP replicates through FSDP2 on a (replicate, shard=1) mesh.
        keep = {"dp_shard"} if self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1) else set()
        names = tuple(n for n, d in dims if d > 1 or n in keep) or ("dp_shard",)
        sizes = tuple(d for n, d in dims if d > 1 or n in keep) or (1,)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        self._named = {name: mesh[name] for name in names if name in ("pp", "tp", "cp")}
        dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
        if dp:
            self._named["dp"] = mesh[dp]._flatten("dp") if len(dp) > 1 else mesh[dp[0]]
        shard = tuple(n for n in ("dp_shard", "cp") if n in names)
        if shard:
            self._named["fsdp"] = mesh[shard]._flatten("fsdp") if len(shard) > 1 else mesh[shard[0]]
            if "dp_replicate" in names:  # HSDP: replicate across the first dim, shard across the second
                self._named["hsdp"] = mesh[("dp_replicate", "fsdp" if len(shard) > 1 else shard[0])]
        self._mesh = mesh
        return mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """A named sub-mesh ("dp", "fsdp", "hsdp", "tp", "cp", "pp"); None when trivial or before ``build_mesh``."""
        return self._named.get(name)
