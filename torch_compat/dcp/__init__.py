"""Guarded Adam/AdamW moments in ``torch.distributed.checkpoint`` (FSDP2/DTensor, resharding).

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path,
             planner=GuardedSavePlanner(tau=0.01, clip=0.2))      # or dcp.async_save
    state = {"model": msd, "optim": osd}                           # any world size
    dcp.load(state, checkpoint_id=path, planner=GuardedLoadPlanner(checkpoint_id=path))

Save: each rank encodes **its own local shards** of every ``exp_avg``/``exp_avg_sq`` pair
(DTensor local tensors, or whole tensors in a plain process) with `jaxguard.encode_many`,
certified against the local shard of the parameter saved in the same call and the lr,
betas, eps, weight decay and step of its param group. Each shard becomes one jaxguard
container (docs/format.md), written as a DCP bytes item ``__jaxguard__/<prefix>@<offsets>``;
the moment tensors themselves are not written. Everything else (weights, ``step``, param
groups) goes through DCP unchanged. The planner records in the DCP metadata
(``metadata.planner_data["__jaxguard__"]``, the *manifest*): for every moment its global
shape and the offsets/sizes, SHA-256 and decoded-moments SHA-256 of every shard; a
SHA-256 of the content of every stored tensor chunk and of every stored bytes item.

Load: each rank reads every stored chunk and shard its targets overlap (through the
storage reader, during DCP's planning step), checks each against the manifest, decodes
the shards (numpy reader, bit-exact) and only then, in ``finish_plan`` (which DCP runs
only after every rank planned without error), copies the requested regions into the
targets. A missing, truncated or altered rank file therefore fails on the rank that
reads it with a one-line `CheckpointError` naming the file, DCP raises it on every rank,
and no model or optimizer tensor has been written on any rank.

Numerical contract: for every coordinate the loaded moments equal the saved ones bitwise
or the first native update after resume (op model ``torch-adam``/``torch-adamw``,
``torch.optim.Adam(foreach=False, fused=False)``, bias corrections at ``step + 1``)
differs from the uncompressed resume by at most ``tau * lr`` for every gradient
``|g| <= clip`` (`jaxguard.core.guard`). The certificate is per coordinate, so it does not
depend on the world size the checkpoint is loaded at. Weights, steps and param groups
load bit-identically to a plain DCP save.

The package by job: ``layout`` (names and shared helpers) <- ``save_planner``,
``verified_read`` <- ``load_planner`` <- ``directory`` (the CLI's verbs on a DCP directory).
"""
from __future__ import annotations

__all__ = ['FORMAT', 'SHARD_PREFIX', 'manifest_of', 'GuardedSavePlanner', 'GuardedFileSystemReader',
           'GuardedLoadPlanner', 'read_metadata', 'load_full', 'restore_dir', 'compress_dir', 'inspect_dir',
           'verify_dir', 'first_update_audit']

from torch_compat.dcp.layout import (FORMAT, MANIFEST_KEY, SHARD_PREFIX, MOMENTS, NOT_GUARDED, manifest_of)  # noqa: F401
from torch_compat.dcp.save_planner import GuardedSavePlanner  # noqa: F401
from torch_compat.dcp.verified_read import read_verified  # noqa: F401
from torch_compat.dcp.load_planner import (GuardedFileSystemReader, GuardedLoadPlanner,
                                           check_next_update)  # noqa: F401
from torch_compat.dcp.directory import (read_metadata, load_full, restore_dir,
                                        compress_dir, inspect_dir, verify_dir, first_update_audit)  # noqa: F401
