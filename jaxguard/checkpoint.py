"""orbax-checkpoint integration: a handler and its args for guarded optax state.

    import orbax.checkpoint as ocp, jaxguard.checkpoint as jgc
    mngr = ocp.CheckpointManager(dir, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=jgc.GuardedSave(opt_state, params=params, lr=1e-3)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        opt_state=jgc.GuardedRestore(like=opt_state)))

`GuardedSave`/`GuardedRestore` are registered with `GuardedCheckpointHandler` through
``orbax.checkpoint.args.register_with_handler``, so `Composite` finds the handler by the
args' type.  The handler is an `AsyncCheckpointHandler`: the guard runs while `save` is
called (it reads the arrays of that step), the file is written in the commit future
(`enable_async_checkpointing=True` writes in the background).  The item directory holds
one jaxguard container, ``opt_state.jaxguard`` (see jaxguard.optax_adapter for the
numerical contract); only the primary host writes it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from etils import epath
from orbax.checkpoint import checkpoint_args
from orbax.checkpoint import utils as ocp_utils
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.handlers import async_checkpoint_handler

from . import container, optax_adapter
from .errors import CheckpointError

FILENAME = "opt_state.jaxguard"


class GuardedCheckpointHandler(async_checkpoint_handler.AsyncCheckpointHandler):
    """Writes/reads optax state as one guarded jaxguard container per checkpoint item."""

    def __init__(self, filename: Optional[str] = None, primary_host: Optional[int] = 0):
        self._filename = filename or FILENAME
        self._primary_host = primary_host

    async def async_save(self, directory: epath.Path, args: "GuardedSave" = None) -> Optional[List[future.Future]]:
        if not isinstance(args, GuardedSave):
            raise CheckpointError("GuardedCheckpointHandler.save needs args=jaxguard.checkpoint.GuardedSave(...)")
        data, summary = optax_adapter.to_bytes(args.opt_state, args.params, lr=args.lr, tau=args.tau,
                                               clip=args.clip, codec=args.codec, weight_decay=args.weight_decay,
                                               betas=args.betas, eps=args.eps, include_params=args.include_params)
        self.last_summary = summary
        path = epath.Path(directory) / self._filename

        async def write():
            if ocp_utils.is_primary_host(self._primary_host):
                container.atomic_write(path, data)

        return [future.CommitFutureAwaitingContractedSignals(write(), name="jaxguard_save")]

    def save(self, directory: epath.Path, args: "GuardedSave" = None):
        async def run():
            for f in await self.async_save(directory, args=args) or []:
                f.result()

        asyncio_utils.run_sync(run())

    def restore(self, directory: epath.Path, args: "GuardedRestore" = None) -> Any:
        if not isinstance(args, GuardedRestore) or args.like is None:
            raise CheckpointError("restoring guarded optax state needs args=jaxguard.checkpoint.GuardedRestore(like), "
                                  "with like a state of the same structure (e.g. tx.init(params))")
        path = epath.Path(directory) / self._filename
        if not path.exists():
            raise CheckpointError(f"{path} does not exist; was this item saved with GuardedSave?")
        return optax_adapter.load(str(path), args.like)

    def metadata(self, directory: epath.Path):
        path = epath.Path(directory) / self._filename
        if not path.exists():
            return None
        header, _, _ = container.read(str(path), verify_decoded=False)
        return {k: header.get(k) for k in ("op_model", "tau", "clip", "codec")}

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self):
        pass


@checkpoint_args.register_with_handler(GuardedCheckpointHandler, for_save=True)
@dataclasses.dataclass
class GuardedSave(checkpoint_args.CheckpointArgs):
    """Save args: the optax state, the params it belongs to and the next update's
    hyperparameters (see `jaxguard.save`)."""

    opt_state: Any
    params: Any = None
    lr: Any = None          # the next update's lr (required): a number or the optax schedule
    tau: float = 0.01
    clip: float = 0.2
    codec: str = "log8-rel"
    weight_decay: Optional[float] = None
    betas: Optional[tuple] = None
    eps: Optional[float] = None
    include_params: bool = False

    def __post_init__(self):
        if self.params is None:
            raise CheckpointError("GuardedSave needs params=...: the guard certifies the next update against the "
                                  "parameters the state belongs to")


@checkpoint_args.register_with_handler(GuardedCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class GuardedRestore(checkpoint_args.CheckpointArgs):
    """Restore args: `like` gives the structure, dtypes and shardings (e.g. tx.init(params))."""

    like: Any = None
