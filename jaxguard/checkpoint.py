"""orbax-checkpoint integration: a handler and its args for guarded optax state.

    import orbax.checkpoint as ocp, jaxguard.checkpoint as jgc
    mngr = ocp.CheckpointManager(dir, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=jgc.GuardedSave(opt_state, params=params, tx=tx)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        opt_state=jgc.GuardedRestore(like=opt_state)))

`GuardedSave`/`GuardedRestore` are registered with `GuardedCheckpointHandler` through
``orbax.checkpoint.args.register_with_handler``, so `Composite` finds the handler by the
args' type.  The handler is an `AsyncCheckpointHandler`: `save` only copies the arrays
of that step to host memory; the guard and the write run in the commit future, on the copy
(with ``enable_async_checkpointing=True`` in orbax's background thread, so the training
step waits only for the copy; a refusal there is raised by ``wait_until_finished`` and
commits no step).  The item directory holds
one jaxguard container, ``opt_state.jaxguard`` (see jaxguard.optax_adapter for the
numerical contract); only the primary host writes it.

Multi-process jobs (or ``GuardedSave(..., sharded=True)``): the item directory holds a
sharded checkpoint (jaxguard.sharded): every process copies its replica-0 shards to host
during `save`, then certifies them and writes ``process_NNNNN.<save id>.jaxguard`` (through
`jaxguard.format.storage`: local paths and fsspec URLs, each file atomic) in its commit
future; `finalize`, which orbax runs on the primary process after every process has
finished writing, merges the per-process indexes into ``manifest.json`` (one atomic
write, as `jaxguard.sharded.commit_manifest`).  orbax renames the temporary step directory only after
that, so a checkpoint is visible only when complete.  When one process's write fails (a
full disk, an I/O error), the commit futures learn it from each other (the JAX distributed
client's key-value store) and every process raises one line from ``wait_until_finished``:
that process its own error, the others a `CheckpointError` naming it; no step is committed.
`GuardedRestore(like)` reads either layout, into `like`'s shardings (any mesh or process count).
"""
from __future__ import annotations

__all__ = ["FILENAME", "GuardedCheckpointHandler", "GuardedSave", "GuardedRestore"]

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Any, List, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future

from jaxguard.format import container
from jaxguard import flax_state, optax_adapter, optax_state, uncovered
from jaxguard.core.config import GuardSpec, UpdateRequest, save_spec
from jaxguard import sharded as _sharded
from jaxguard.errors import CheckpointError

FILENAME = "opt_state.jaxguard"
TMP_MARK = ".orbax-checkpoint-tmp"   # orbax's temporary step directory: "<step>.orbax-checkpoint-tmp[-...]"


def _run_sync(coro):
    """Run ``coro`` to completion from synchronous code, also when an event loop is
    already running in this thread (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _host_copy(x):
    """A host copy of one leaf that no later step can change (a numpy array the caller may
    change in place; a JAX array copied, not viewed)."""
    if isinstance(x, (jax.Array, np.ndarray)):
        try:
            return np.array(x, copy=True)
        except TypeError:      # no numpy form (a typed PRNG key): a device copy instead
            return jax.numpy.copy(x)
    return x


class _HostBuffers:
    """What `GuardedCheckpointHandler.async_save` reads after its call returned: a snapshot
    of the state that no later step can change, taken as cheaply as orbax takes its own.

    A CPU JAX array is taken as a numpy view, no copy (orbax's `StandardSave` does the
    same): the runtime does not donate a buffer that a host view holds, so a donating next
    step writes its result elsewhere (checked for this JAX by tests/optax/test_async_save.py), and
    `donated` tells afterwards whether any viewed array was donated all the same (the save
    then refuses).  An array on another device is taken as the host copy its transfer makes
    (started for every leaf before the first is read).  numpy leaves, which the caller may
    change in place, are copied into host buffers lent
    again to the next save once the encode that read them has finished: a fresh
    allocation's first-touch page faults cost about as much again as the copy itself (141
    MB, measured: 25 ms into fresh arrays, 8 ms into buffers written before;
    bench/experiments/host_copy.py)."""

    def __init__(self):
        self._free: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(x):
        return tuple(x.shape), np.dtype(x.dtype).str

    def lend(self):
        """-> (snapshot, lent, viewed): `snapshot(leaf)` is ``np.asarray`` of a JAX array (a
        view on CPU), or `_host_copy` into a free buffer of the leaf's shape and dtype where
        there is one;
        `lent` lists the buffers used, `viewed` the arrays taken as views."""
        with self._lock:
            free, self._free = self._free, {}
        lent, viewed = [], []

        def snapshot(x):
            numeric = isinstance(x, (jax.Array, np.ndarray)) and np.dtype(x.dtype).kind in "biuf"
            if numeric and isinstance(x, jax.Array) and x.is_fully_addressable:
                if all(d.platform == "cpu" for d in x.devices()):
                    viewed.append(x)
                return np.asarray(x)   # on other devices: the host copy the transfer made
            if numeric and isinstance(x, np.ndarray) and free.get(self._key(x)):
                buf = free[self._key(x)].pop()
                np.copyto(buf, x)
            else:
                buf = _host_copy(x)
            if isinstance(buf, np.ndarray):
                lent.append(buf)
            return buf
        return snapshot, lent, viewed

    @staticmethod
    def donated(viewed) -> list:
        """The arrays of `viewed` that a later step donated (their views may have changed)."""
        return [x for x in viewed if x.is_deleted()]

    def give_back(self, lent):
        """Make `lent` (buffers no encode reads any more) available to the next `lend`."""
        with self._lock:
            for b in lent:
                self._free.setdefault(self._key(b), []).append(b)


def _host_record(rec):
    """A writer record whose arrays are host copies (see `_host_copy`)."""
    if isinstance(rec, container.Raw):
        return rec._replace(array=_host_copy(rec.array))
    if dataclasses.is_dataclass(rec):
        return dataclasses.replace(rec, **{f: _host_copy(getattr(rec, f)) for f in ("m", "v", "p")})
    return rec


def _failed_processes_in_commit(directory: str, save_id: str, pid: int, ok: bool) -> list:
    """Every process says, from its commit future, whether it wrote its shards; all learn who
    failed.  Through the JAX distributed client's key-value store, not a collective (a commit
    future runs in orbax's background thread, beside the training step's collectives).

    Without it, a process whose write raised leaves orbax's background thread before orbax's
    ``async_write_complete`` barrier while the others wait there: every process of the job
    then blocks for ``AsyncOptions.timeout_secs`` (1200 s by default) instead of raising.

    Args:
      directory: the item directory (named in the error).
      save_id: the save's id (the same on every process: it names the keys).
      pid: this process.
      ok: whether this process wrote its files.

    Returns:
      The sorted indexes of the processes that failed (empty: all wrote).

    Raises:
      CheckpointError: another process did not report within orbax's default
        ``AsyncOptions.timeout_secs`` (it died, or the coordination service did).
    """
    n = jax.process_count()
    from jax._src import distributed     # orbax's barriers use this client too
    client = distributed.global_state.client
    if n == 1 or client is None:
        return [] if ok else [pid]
    prefix = f"jaxguard/orbax_commit/{save_id}/"
    client.key_value_set(prefix + str(pid), "ok" if ok else "failed")
    timeout_ms = int(ocp.AsyncOptions().timeout_secs * 1000)
    failed = []
    for i in range(n):
        try:
            got = client.blocking_key_value_get(prefix + str(i), timeout_ms)
        except Exception as exc:  # noqa: BLE001 - a dead process or coordination service
            text = str(exc).strip()
            raise CheckpointError(f"{directory}: process {i} of this job did not say whether it wrote its shards "
                                  f"({type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}); orbax "
                                  "commits no step, the previous steps are kept") from None
        if got != "ok":
            failed.append(i)
    return failed


class GuardedCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Writes/reads optax state as one guarded jaxguard container per checkpoint item."""

    def __init__(self, filename: Optional[str] = None, primary_host: Optional[int] = 0):
        self._filename = filename or FILENAME
        self._primary_host = primary_host
        self._buffers = _HostBuffers()
        self._common = {}
        self._failed: list = []     # temporary step directories of saves that failed in the background

    async def async_save(self, directory: epath.Path, args: "GuardedSave" = None) -> Optional[List[future.Future]]:
        """Take a host snapshot of the state and return the futures that encode and write it
        (orbax's async API): the caller is blocked only for the snapshot (views of CPU
        arrays, as orbax's own async save takes them; transfers from other devices), and
        the guard runs in the commit future, on the snapshot (`_HostBuffers`).

        One process (or ``args.sharded=False``): the whole state is encoded into one container
        and the primary host writes it atomically. Several processes (or ``args.sharded=True``):
        each writes its shards and the manifest is committed in `finalize`.  The bytes written
        are those of a blocking save of the same state.  A refusal in the background encode
        (e.g. certified values the reader does not decode to) writes nothing and raises from
        orbax's ``wait_until_finished``; orbax then leaves the step
        uncommitted.

        Args:
          directory: the item directory orbax gives the handler.
          args: a `GuardedSave` (state, params, lr, tau, clip, codec, ...).

        Returns:
          A list of orbax commit futures; once they are done ``self.last_summary`` holds the
          save's summary.

        Raises:
          CheckpointError: `args` is not a `GuardedSave`.  A state the guard refuses (no Adam
            state, mismatched params, dtypes, lr: as `jaxguard.save`) fails in the futures and
            is raised by orbax's ``wait_until_finished`` (raising it from this call instead
            leaves orbax's step-directory signal unsent, and its thread waits out the timeout).
        """
        if not isinstance(args, GuardedSave):
            raise CheckpointError("GuardedCheckpointHandler.save needs args=jaxguard.checkpoint.GuardedSave(...)")
        self._remove_failed()
        if args.sharded or (args.sharded is None and jax.process_count() > 1):
            return self._async_save_sharded(directory, args)
        for x in jax.tree_util.tree_leaves((args.opt_state, args.params)):   # start every transfer first
            if isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices()):
                x.copy_to_host_async()
        snapshot, lent, viewed = self._buffers.lend()
        opt_state, params = jax.tree_util.tree_map(snapshot, (args.opt_state, args.params))
        path = str(epath.Path(directory) / self._filename)
        primary = ocp.utils.is_primary_host(self._primary_host)

        async def write():
            try:
                data, summary = optax_adapter.encode_state(opt_state, params, update=None, spec=args.guard_spec(),
                                                           include_params=args.include_params,
                                                           fixed=args.next_updates)
                if self._buffers.donated(viewed):
                    raise CheckpointError(f"{path}: an array of the state was donated to a later step while this "
                                          "async save read it (this JAX donated a buffer a host view held); nothing "
                                          "was written; save with enable_async_checkpointing=False, or without "
                                          "donating the state")
                self.last_summary = summary
                if primary:
                    container.atomic_write(path, data)
            except Exception:
                self._failed_in(directory)
                raise
            finally:
                self._buffers.give_back(lent)

        return [future.CommitFutureAwaitingContractedSignals(write(), name="jaxguard_save")]

    def _async_save_sharded(self, directory, args):
        spec = args.guard_spec()
        plan = _sharded.plan_state(args.opt_state, args.params, spec=spec, fixed=args.next_updates)
        primary = self._primary_host or 0
        local = _sharded.plan_local(plan, args.opt_state, args.params, spec=spec, include_params=args.include_params,
                                    primary=primary)
        items = [(entry, start, _host_record(rec)) for entry, start, rec in local.items]
        totals, extra = local.totals, local.header
        pid = jax.process_index()
        save_id = _sharded.new_save_id(primary)   # a collective, here on the calling thread of every process
        self._common[str(directory)] = (local.common, save_id)

        async def write():
            err = None
            try:
                data, index = _sharded.build_local(items, totals, process=pid, extra_header=extra)
                self.last_summary = {**optax_adapter.summary(totals, len(data)), "process_index": pid}
                _sharded.write_process_files(str(directory), data, index, pid, save_id)
            except Exception as exc:  # noqa: BLE001 - every process must learn of it (below)
                err = exc
            failed = _failed_processes_in_commit(str(directory), save_id, pid, err is None)
            if failed:
                _sharded.remove_process_files(str(directory), pid, save_id)
                self._failed_in(directory)
                if err is not None:
                    raise err
                raise CheckpointError(f"{directory}: process{'es' if len(failed) > 1 else ''} "
                                      f"{', '.join(map(str, failed))} could not write "
                                      f"{'their' if len(failed) > 1 else 'its'} shards; orbax commits no "
                                      "step, the previous steps are kept")

        return [future.CommitFutureAwaitingContractedSignals(write(), name="jaxguard_sharded_save")]

    def save(self, directory: epath.Path, args: "GuardedSave" = None):
        """`async_save` and wait for its writes.

        Args:
          directory: the item directory.
          args: a `GuardedSave`.

        Raises:
          CheckpointError: as `async_save`.
        """
        async def run():
            for f in await self.async_save(directory, args=args) or []:
                f.result()

        _run_sync(run())

    def restore(self, directory: epath.Path, args: "GuardedRestore" = None) -> Any:
        """Read the guarded state back (one container or a sharded directory).

        Args:
          directory: the item directory.
          args: a `GuardedRestore` whose ``like`` has the saved state's structure (e.g.
            ``tx.init(params)``).

        Returns:
          The optax state with the decoded moments (as `jaxguard.load`).

        Raises:
          CheckpointError: no ``like``, or no guarded item in the directory.
        """
        if not isinstance(args, GuardedRestore) or args.like is None:
            raise CheckpointError("restoring guarded optax state needs args=jaxguard.checkpoint.GuardedRestore(like), "
                                  "with like a state of the same structure (e.g. tx.init(params))")
        if (epath.Path(directory) / _sharded.MANIFEST).exists():
            return optax_adapter.load(str(directory), args.like)
        path = epath.Path(directory) / self._filename
        if not path.exists():
            raise CheckpointError(f"{path} does not exist; was this item saved with GuardedSave?")
        return optax_adapter.load(str(path), args.like)

    def metadata(self, directory: epath.Path):
        """The certificate settings of a saved item, without decoding the moments.

        Args:
          directory: the item directory.

        Returns:
          ``{"op_model", "tau", "clip", "codec"}`` (plus ``"process_count"`` for a sharded
          save), or None when the directory holds no container.
        """
        if (epath.Path(directory) / _sharded.MANIFEST).exists():
            man = _sharded.read_manifest(str(directory))
            return {k: man.get(k) for k in ("op_model", "tau", "clip", "codec", "process_count")}
        path = epath.Path(directory) / self._filename
        if not path.exists():
            return None
        header, _, _ = container.read(str(path), verify_decoded=False)
        return {k: header.get(k) for k in ("op_model", "tau", "clip", "codec")}

    def finalize(self, directory: epath.Path) -> None:
        # orbax calls this on the primary process once every process has written
        """Commit the sharded manifest once every process has written (orbax calls it on the
        primary process); nothing to do after a one-file save.

        Args:
          directory: the item directory.
        """
        got = self._common.pop(str(directory), None)
        if got is None and len(self._common) == 1:
            sid = next(iter(self._common.values()))[1]
            if (epath.Path(directory) / (_sharded.file_name(0, sid) + _sharded.INDEX_SUFFIX)).exists():
                got = self._common.pop(next(iter(self._common)))
        if got is not None:
            _sharded.commit_manifest(str(directory), got[0], jax.process_count(), got[1])

    def _failed_in(self, directory) -> None:
        """Remember the temporary step directory of a save that failed in the background:
        orbax commits no step and leaves it behind; `_remove_failed` removes it."""
        step_dir = epath.Path(directory).parent
        if TMP_MARK in step_dir.name and ocp.utils.is_primary_host(self._primary_host):
            self._failed.append(step_dir)

    def _remove_failed(self) -> None:
        """Remove the temporary directories of failed saves (at the next save and at close,
        once orbax has raised the failure and the step's other items are done)."""
        while self._failed:
            step_dir = self._failed.pop()
            try:
                if step_dir.exists() and TMP_MARK in step_dir.name:
                    step_dir.rmtree()
            except OSError:   # best effort: a cleanup must not hide the save's own error
                pass

    def close(self):
        """Remove what failed saves left behind (orbax's handler protocol: the manager closes it)."""
        self._remove_failed()


@ocp.args.register_with_handler(GuardedCheckpointHandler, for_save=True)
@dataclasses.dataclass
class GuardedSave(ocp.args.CheckpointArgs):
    """Save args: the optax state, the params it belongs to and the next update's
    hyperparameters (see `jaxguard.save`).

    The next update of every moment pair is resolved when the args are built
    (`optax_state.plan_updates`: `tx`'s probes, the given values), before orbax creates the
    step's directory: a refusal (a wrong ``lr=``, an Adam variant, a bad hyperparameter)
    raises from this constructor, at its own step, and leaves no temporary directory.
    The background encode then uses those updates (``next_updates``).

    Moments the guarantee does not cover (bfloat16 or float16 parameters, an Adam variant
    that `tx` reveals, ``eps_root``) are stored exactly, each leaf saying why, with one
    warning line from this constructor (``uncertifiable="exact"``, the default: a save is
    never lost to the guard; ``"refuse"`` raises as `jaxguard.save` does).  A state with
    no Adam state at all (lion, adafactor) is refused here: there is nothing to guard, save
    it with orbax's own handlers."""

    opt_state: Any
    params: Any = None
    lr: Any = None          # the next update's lr (required without tx): as jaxguard.save
    spec: Optional[GuardSpec] = None     # the guard settings (default GuardSpec()); the fields below override it
    tau: Optional[float] = None
    clip: Optional[float] = None
    codec: Optional[str] = None
    weight_decay: Optional[float] = None
    betas: Optional[tuple] = None
    eps: Optional[float] = None
    include_params: bool = False
    sharded: Optional[bool] = None
    op_model: Optional[str] = None       # the optax kernel the run resumes on (see jaxguard.save)
    tx: Any = None                       # the optax transformation: the next update is read from it (jaxguard.save;
                                         # required with an nnx.State, whose optax types are rebuilt from it)
    uncertifiable: str = "exact"         # what the guarantee does not cover: stored exactly ("refuse": raise)

    def __post_init__(self):
        # Flax state as plain optax pytrees (jaxguard.flax_state); no params: "GuardedSave needs params=..."
        self.opt_state, self.params, self.tx = flax_state.save_inputs(self.opt_state, self.params, self.tx,
                                                                      what="GuardedSave's opt_state")
        self.guard_spec()   # bad settings fail here, in one line
        plans = optax_state.plan_updates(self.opt_state, self.params, update=self.update_request(),
                                         sites=optax_state.find_adam_states(_sharded.host_scalars(self.opt_state)))
        self.next_updates = optax_state.updates_by_pair(plans)
        uncovered.warn("GuardedSave", [s for s in optax_state.stored_exactly(plans)
                                       if s["why"] != optax_state.EXACT_REASON],
                       of=sum(len(p.pairs) + len(p.uncovered) for p in plans))

    def guard_spec(self) -> GuardSpec:
        """The save's `GuardSpec`: `spec` with the given fields (`jaxguard.core.config.save_spec`)."""
        return save_spec(self.spec, tau=self.tau, clip=self.clip, codec=self.codec)

    def update_request(self) -> UpdateRequest:
        """The save's `UpdateRequest`: the next update's hyperparameters as given."""
        return UpdateRequest(lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps,
                             op_model=self.op_model, tx=self.tx, uncertifiable=self.uncertifiable)


@ocp.args.register_with_handler(GuardedCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class GuardedRestore(ocp.args.CheckpointArgs):
    """Restore args: `like` gives the structure, dtypes and shardings (e.g. tx.init(params))."""

    like: Any = None
