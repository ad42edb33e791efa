"""One moment pair, as every adapter, the writer, the jit hook and DCP hand it on.

A `MomentJob` is an Adam moment pair whose next update is known: its identity (entry
name, parameter name, mu/nu paths in the optimizer state, shape), its placement (a DCP
shard's offsets and sizes, or a jit mesh and `PartitionSpec`), the next update's
`GuardConfig`, the mu mode (``"coded"``: both moments coded; ``"exact"``: only nu coded,
mu stored exactly under `raw_entry`), the arrays when present, and the release handle.
`optax_state.lay_out` builds one per certified pair of an optax state (whole leaves,
arrays not read); the single-file save, the sharded planner, the orbax handler and the jit
hook derive theirs from it (`dataclasses.replace` with a shard's arrays); torch_compat's
state_dict save and DCP's save planner build theirs from tensors.  `jaxguard.writer`
certifies and encodes them.

The jit hook's cache key must not hold arrays: `MomentJob.static` is the hashable view of
a pair's layout (`MomentStatic`).

The optax walk's earlier record, `optax_state.MomentPair`, is a different stage: the
moments of a parameter found in the tree before their next update (and so their config,
entry and mu mode) is known.

Numerical contract
------------------
None here: a `MomentJob` only carries a pair; what the writer certifies for it is
`jaxguard.core.guard.encode`'s contract for its `config` (module `jaxguard.writer`).
"""
from __future__ import annotations

__all__ = ["MomentJob", "MomentStatic", "MU_MODES"]

import dataclasses
from typing import Any

import numpy as np

from jaxguard.core.config import GuardConfig, GuardSpec

MU_MODES = ("coded", "exact")


@dataclasses.dataclass(frozen=True)
class MomentStatic:
    """The hashable static view of a `MomentJob` (part of the jit hook's cache key): no
    arrays, no per-step constants.

    Attributes:
      entry, mu_path, nu_path, param, shape, mesh, partition_spec: the job's.
      row: the row of its certificate constants in the jit hook's `StateConstants.k`
        (pairs certified alike share one).
      spec: the static part of the job's `GuardConfig` (its `GuardSpec`).
    """

    entry: str
    mu_path: str
    nu_path: str
    param: str
    row: int
    spec: GuardSpec
    shape: tuple
    mesh: Any
    partition_spec: Any


@dataclasses.dataclass(frozen=True, eq=False)
class MomentJob:
    """One moment pair to certify and store as the container entry `name`.

    Attributes:
      name: the container entry name (a DCP shard: its moment's prefix).
      m, v, p: float32 arrays of one shape (numpy, or anything `np.asarray` takes
        without copying: a CPU tensor's ``.numpy()``, a host JAX array).  A job from
        `optax_state.lay_out` with ``mu="exact"`` holds the bfloat16 leaf as `m`; the adapter
        widens it to float32 (exactly) before it hands the job to the writer.
        None where a walk has not read them.
      config: the next update's `GuardConfig`.
      info: the adapter's entry fields stored beside the config (``param``: the
        parameter's name; DCP offsets, ...), in the order they are written.  A value may
        be a callable of no arguments, called when the entry is produced: a parameter's
        digest is then computed in the encode thread while slabs certify, not before the
        first slab.
      mu: ``"coded"`` (both moments coded) or ``"exact"`` (only v coded; m stored
        exactly in the entry `raw_entry`).
      source: handed to the writer's ``release`` once the entry is written (e.g. the
        torch tensors of a memory-mapped checkpoint).
      param: the parameter's name (dotted path in params, or torch's name).
      mu_path, nu_path: the moments' dotted paths in the optimizer state ("" where the
        adapter has none).
      raw_entry: the entry of the exact mu (``mu="exact"``).
      site: the index of its Adam site in `optax_state.StateLayout.plans` (-1: none).
      shape: the parameter's whole shape (None: the shape of `m`).
      offsets, sizes: a DCP shard's placement in the whole tensor (None: the whole).
      mesh, partition_spec: a jit leaf's `jax.sharding.Mesh` and `PartitionSpec` (None:
        one device or the host).
    """

    name: str
    m: Any
    v: Any
    p: Any
    config: GuardConfig
    info: dict = dataclasses.field(default_factory=dict)
    mu: str = "coded"
    source: Any = None
    param: str = ""
    mu_path: str = ""
    nu_path: str = ""
    raw_entry: str = ""
    site: int = -1
    shape: tuple | None = None
    offsets: tuple | None = None
    sizes: tuple | None = None
    mesh: Any = None
    partition_spec: Any = None

    @property
    def size(self) -> int:
        """Returns: the coordinate count of the arrays (of `shape` when they are absent)."""
        if self.m is None:
            return int(np.prod(self.shape, dtype=np.int64))
        return int(np.size(self.m))

    @property
    def mu_mode(self) -> str:
        """Returns: the entry's stored ``mu_mode``: ``"coded"``, or ``"raw-bfloat16"``
        (mu stored exactly under `raw_entry`, nu coded)."""
        return "coded" if self.mu == "coded" else "raw-bfloat16"

    def with_arrays(self, m, v, p, **changes) -> "MomentJob":
        """Returns: this job with other arrays and fields.

        Args:
          m, v, p: the arrays (a shard's, a host copy's).
          **changes: other fields to replace.
        """
        return dataclasses.replace(self, m=m, v=v, p=p, **changes)

    def static(self, row: int, config: GuardConfig | None = None) -> MomentStatic:
        """Returns: the hashable `MomentStatic` of this job (no arrays: a jit cache key).

        Args:
          row: its row of certificate constants.
          config: the config the row certifies (default the job's `config`).
        """
        cfg = self.config if config is None else config
        shape = tuple(self.shape) if self.shape is not None else tuple(np.shape(self.m))
        return MomentStatic(self.name, self.mu_path, self.nu_path, self.param, row, cfg.spec, shape, self.mesh,
                            self.partition_spec)
