"""Process coordination of a sharded save, and host views of global arrays: the save's id
broadcast from the primary, barriers, who failed, and the replica-0 shards each process writes."""
from __future__ import annotations

__all__ = ["new_save_id", "barrier", "failed_processes", "host_scalar", "host_scalars", "shard_start",
           "local_shards", "aligned"]

import secrets
import time

import jax
import numpy as np


def new_save_id(primary: int = 0) -> str:
    """A fresh save id, the same on every process: the primary's clock (ns, 16 hex digits)
    and 8 random hex digits, broadcast from the primary (a collective: every process calls it).

    Random, not derived from the step or the old manifest: two jobs saving to one path
    must not pick the same file names.  The clock prefix orders saves by start, so a commit
    removes only the leftovers of saves that started before it.

    Args:
      primary: the process whose id every process takes.

    Returns:
      24 lowercase hex digits.
    """
    sid = f"{time.time_ns():016x}{secrets.token_hex(4)}"
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        words = np.frombuffer(bytes.fromhex(sid), dtype="<u4").copy()
        got = multihost_utils.broadcast_one_to_all(words, is_source=jax.process_index() == primary)
        sid = np.asarray(got).astype("<u4").tobytes().hex()
    return sid


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing with one process).

    Args:
      name: the barrier's name, the same on every process.
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def failed_processes(ok: bool) -> list:
    """Every process says whether its step succeeded; all learn who failed (a collective).

    Args:
      ok: this process's outcome.

    Returns:
      The sorted indexes of the processes that passed ``ok=False`` (empty: all succeeded).
    """
    if jax.process_count() == 1:
        return [] if ok else [0]
    from jax.experimental import multihost_utils
    flags = np.asarray(multihost_utils.process_allgather(np.array([1 if ok else 0], np.int32))).reshape(-1)
    return [i for i, f in enumerate(flags.tolist()) if not f]


# ---------------------------------------------------------------- host views of global arrays
def host_scalar(x):
    """A 0-d leaf as a host value; a global (non fully addressable) scalar reads its local copy.

    Args:
      x: any leaf.

    Returns:
      A numpy scalar array for a global 0-d `jax.Array`, else `x` unchanged.
    """
    if isinstance(x, jax.Array) and x.ndim == 0 and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return x


def host_scalars(tree):
    """Args: tree: any pytree.  Returns: `tree` with `host_scalar` applied to every leaf."""
    return jax.tree_util.tree_map(host_scalar, tree)


def shard_start(index, ndim) -> tuple:
    """The global offset of a shard from its index (a tuple of slices).

    Args:
      index: a shard's ``index`` (slices per leading dimension; ``None`` starts are 0).
      ndim: the array's rank (missing trailing dimensions start at 0).

    Returns:
      The start offset per dimension, a tuple of ``ndim`` ints.
    """
    return tuple(0 if s.start is None else int(s.start) for s in index) + (0,) * (ndim - len(index))


def local_shards(x, primary=0):
    """The replica-0 shards of `x` this process holds.

    Args:
      x: a `jax.Array`, or a host (numpy / Python) leaf: one shard, written by the primary.
      primary: the process that writes host leaves.

    Returns:
      [(device or None, global start index, host array)].
    """
    if isinstance(x, jax.Array):
        return [(s.device, shard_start(s.index, x.ndim), s.data) for s in x.addressable_shards if s.replica_id == 0]
    if jax.process_index() == primary:
        a = np.asarray(x)
        return [(None, (0,) * a.ndim, a)]
    return []


def aligned(x, like):
    """`x` laid out like `like` ({device: shard array}), or a host array when `like` is one.

    Differently sharded inputs are copied to `like`'s sharding with a jitted identity (a
    collective: every process reaches it in the same order, as it walks the same tree).

    Args:
      x: the array to lay out (a `jax.Array` or host array of `like`'s shape).
      like: the reference layout (a `jax.Array`, or a host leaf).

    Returns:
      {device: shard data} of `x` in `like`'s sharding, or a numpy array when `like` is on the host.
    """
    if not isinstance(like, jax.Array):
        return np.asarray(host_scalar(x)) if isinstance(x, jax.Array) and x.ndim == 0 else np.asarray(x)
    if not isinstance(x, jax.Array):
        host = np.asarray(x)
        x = jax.make_array_from_callback(like.shape, like.sharding, lambda idx: host[idx])
    elif not x.sharding.is_equivalent_to(like.sharding, like.ndim):
        x = jax.jit(lambda a: a, out_shardings=like.sharding)(x)
    return {s.device: s.data for s in x.addressable_shards}
