"""Sharded checkpoints of optax state: one container per process plus a manifest.

In a multi-process JAX job every process calls ``jaxguard.save(DIR, opt_state, params,
...)`` with the same ``DIR``.  Each process certifies and writes only the shards of its
addressable devices with ``replica_id == 0`` (a replicated leaf is written once, by the
process holding its replica 0); no process gathers a leaf it does not own.  Layout::

    DIR/process_00000.<SAVE>.jaxguard   one container v1 (docs/format.md) per process: a
    DIR/process_00001.<SAVE>.jaxguard   moments entry per Adam shard ("<leaf>@<start>") and
    ...                                 a raw entry per shard of every other leaf
    DIR/manifest.json                   written last, by the primary process, in one atomic
                                        replace (one PUT on an object store)

``SAVE`` is the save's id (`new_save_id`: 16 hex digits of the primary's clock in ns and 8
random ones, broadcast to every process), so a save never overwrites a file that the
committed manifest names: the previous checkpoint stays whole until the new manifest
replaces it, whatever happens to the save (a killed process, a full disk, an exception in
one process).  After the replace the primary removes the files no manifest names any more
(the previous save's, and the leftovers of interrupted saves that started earlier).  The
manifest holds the tree (dotted leaf paths, global shapes, dtypes), the sites' guard
configurations, every shard's file, global start offset, shape, byte range and SHA-256,
and each file's size and trailing SHA-256.  A checkpoint exists once the manifest exists:
a directory without one, or whose manifest names a missing or short file, is refused.
Directories of the older layout (``process_00000.jaxguard``, no save id) load as before.

`load(DIR, like)` rebuilds `like`'s tree with `like`'s shardings, in any process count
or mesh: each process reads (with seeks) and checks only the shards that overlap its
addressable devices' slices, decodes them with the numpy reader and assembles its slices
(`jax.make_array_from_callback`).  Each shard decodes to fixed bits, so the restored
values do not depend on the topology that loads them; how a leaf was blocked (256-blocks
run over each shard's row-major coordinates) depends on the writer's sharding.

The package is laid out by job: `jaxguard.format.manifest` (names, schema, checks of the
manifest as untrusted input), `processes` (save id, barriers, host views of global arrays),
`planning` (what every leaf becomes, each process's shard records and file), `commit`
(writing, committing and cleaning up) and `reading` (shards, assembly, `load`, `verify`).

Numerical contract
------------------
As `jaxguard.optax_adapter`: every Adam coordinate is certified in its shard against the
same coordinate of ``params`` (brought to the moments' sharding first), so the first
update after `load` is within ``tau * lr`` of the saved state's for every ``|g| <= clip``;
every other leaf is restored bit-exactly.
"""
from __future__ import annotations
from __future__ import annotations

__all__ = ["MANIFEST", "INDEX_SUFFIX", "file_name", "new_save_id", "is_sharded", "host_scalar",
           "host_scalars", "shard_start", "local_shards", "StatePlan", "LocalSave", "plan_state", "plan_local", "build_local", "encode_local",
           "param_leaves", "commit_manifest", "remove_unnamed", "check_files", "first_op_model",
           "common_meta", "write_process_files", "remove_process_files", "save", "prepare_directory",
           "write_and_commit", "read_manifest", "certified_configs", "load", "verify"]

from jaxguard.format.manifest import INDEX_SUFFIX, MANIFEST, check_files, file_name, read_manifest
from jaxguard.sharded.commit import (commit_manifest, prepare_directory, remove_process_files, remove_unnamed, save,
                                     write_and_commit, write_process_files)
from jaxguard.sharded.planning import (LocalSave, StatePlan, build_local, common_meta, encode_local, first_op_model,
                                       param_leaves, plan_local, plan_state)
from jaxguard.sharded.processes import host_scalar, host_scalars, local_shards, new_save_id, shard_start
from jaxguard.sharded.reading import certified_configs, is_sharded, load, verify
