"""Lightning ``CheckpointIO`` plugin writing each checkpoint as one jaxguard container.

``Trainer(plugins=[GuardedCheckpointIO()])``: every checkpoint Lightning writes
(``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes a container at the same path,
with every Adam/AdamW moment pair in ``optimizer_states`` guarded against the weights in
``state_dict`` (the next update's parameters), and everything else stored exactly
(tensors raw, numbers/strings/lists/dicts as JSON; nothing is pickled).
``trainer.fit(..., ckpt_path=...)`` reads it back through `load_checkpoint`.

Guarantee: for every coordinate, the first update after resuming differs from the update
the uncompressed state would give by at most ``tau * lr`` for every gradient
``|g| <= clip`` (``gradient_clip_val=clip`` with the "norm" algorithm makes every
coordinate obey it).

The optimizer is compressed when it is built from named parameters, e.g.
``torch.optim.AdamW(self.named_parameters(), lr=...)`` in ``configure_optimizers``, so
that its state_dict carries ``param_names`` matching ``state_dict`` keys (or when each
moment's shape names one weight). What the guard cannot certify (an optimizer without
provable names, bfloat16/float16 parameters or moments, amsgrad, an optimizer that is not
Adam beside one that is) is stored exactly, with one warning line (`jaxguard.uncovered`;
docs/coverage.md): every checkpoint is written. Checkpoint values must be tensors,
numbers, strings, lists, dicts, numpy values or ``argparse.Namespace`` (``save_hyperparameters``
of plain values is fine). ``LightningModule.load_from_checkpoint`` reads torch pickles only:
load weights with ``GuardedCheckpointIO().load_checkpoint(path)["state_dict"]``.
Paths may be fsspec URLs (``s3://...``); ``storage_options`` go to fsspec. A checkpoint
where a param group's lr is 0 (the end of a schedule that decays to 0) is written in
Lightning's own uncompressed format, which `load_checkpoint` also reads: the guarantee is
relative to lr and there is nothing to certify against.

Resuming on another kernel: each container records the op model that certified each
moment pair (``op_model=`` names the kernel the run resumes on, e.g.
``"torch-adam-cuda-foreach"`` for a checkpoint written on a CPU machine for a GPU run).
Lightning loads the returned state into the live optimizer itself, after this plugin has
returned it, so `load_checkpoint` leaves a one-shot check behind: at the first step of the
optimizer whose param groups carry the loaded ``param_names`` (after Lightning moved it
to its device), a param group that runs another kernel than the certified one warns one
line, as `torch_compat.load` does (`torch_compat.state.warn_other_kernel`), and so does one
that will step with other hyperparameters than its moments were certified for (a learning
rate set after the restore; `torch_compat.state.check_next_update`; ``strict=True``
raises from that step instead, before it updates anything).
"""
from __future__ import annotations

__all__ = ["GuardedCheckpointIO"]

import io
import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from jaxguard import uncovered, writer
from jaxguard.format import storage
from jaxguard.errors import CheckpointError


class GuardedCheckpointIO(CheckpointIO):
    """Lightning checkpoints as jaxguard containers (module docstring).

    Args:
      tau: the first-update tolerance, a fraction of ``lr`` (default: the spec's, 0.01).
      clip: the gradient bound ``C`` the guarantee covers (default: the spec's, 0.2).
      codec: the moment codec (default: the spec's, ``jaxguard.DEFAULT_CODEC``).
      spec: the guard settings, a `jaxguard.GuardSpec`; the arguments above override it.
      op_model: the kernel the run resumes on (`torch_compat.state.op_model_of`; None: the
        one torch runs where the state lives).
      device_encode: where moments are encoded (`jaxguard.writer.device_encode_setting`;
        None: on the GPU for CUDA state when JAX has a GPU backend).
      strict: at the first step after a resume, a param group stepping with other
        hyperparameters than certified raises instead of warning.
    """

    def __init__(self, tau: float | None = None, clip: float | None = None, codec: str | None = None, *, spec=None,
                 op_model: str | None = None, device_encode: bool | None = None, strict: bool = False):
        from jaxguard.core.config import save_spec
        self.spec = save_spec(spec, tau=tau, clip=clip, codec=codec)
        self.tau, self.clip, self.codec = self.spec.tau, self.spec.clip, self.spec.codec
        self.op_model, self.device_encode, self.strict = op_model, device_encode, strict
        self.last_summary: dict | None = None
        self._resume_check = None

    def to_bytes(self, checkpoint: dict[str, Any]) -> tuple[bytes, dict]:
        """A Lightning checkpoint dict -> (container bytes, summary of the guarded moments).

        Args:
          checkpoint: the dict Lightning saves (``state_dict``, ``optimizer_states`` whose
            param groups carry ``param_names``, and any other picklable-free values).

        Returns:
          ``(data, summary)``: the container bytes and the save totals (coordinates, escapes,
          payload, ...) plus ``container_bytes``.

        Raises:
          CheckpointError: no ``state_dict``, or a value that cannot be stored without
            pickling.

        Warns:
          JaxguardWarning: one line naming what the guard could not certify and stored
            exactly (bfloat16/float16 parameters or moments, amsgrad, an optimizer that is
            not Adam, an optimizer without ``param_names`` whose map to the weights is not
            provable: `jaxguard.uncovered`).
        """
        from torch_compat import state as tstate
        if "state_dict" not in checkpoint:
            raise CheckpointError("the Lightning checkpoint has no 'state_dict'; GuardedCheckpointIO needs the "
                                  "model weights (do not save with weights_only of the optimizer alone)")
        params = checkpoint["state_dict"]
        update = tstate.torch_update_request(op_model=self.op_model, uncertifiable="exact")
        raws: list = []
        records: list = []
        top = []
        notes: dict = {}
        total = 0
        for key, value in checkpoint.items():
            if key != "optimizer_states":
                top.append([key, tstate.to_skeleton(value, str(key), raws)])
                continue
            opts = []
            for i, sd in enumerate(value):
                opt_sk, recs = tstate.state_records(sd, params, spec=self.spec, prefix=f"optimizer_states/{i}",
                                                    update=update, notes=notes)
                records += recs
                opts.append(opt_sk)
                total += len(sd.get("state", ()))
            top.append([key, {"__list__": opts}])
        meta = {"framework": "torch", "tree": {"__dict__": top}, "torch_version": torch.__version__,
                "source": "lightning", **notes}
        extra = {"tau": self.tau, "clip": self.clip, "codec": self.codec}
        data, summary = writer.to_bytes(records + raws, meta, extra_header=extra, device_encode=self.device_encode)
        summary["stored_exactly"] = notes.get("stored_exactly", [])
        uncovered.warn("GuardedCheckpointIO", summary["stored_exactly"], of=total)
        return data, summary

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Write `checkpoint` atomically as a guarded container (Lightning's CheckpointIO API).

        A checkpoint with a param group at lr 0 (nothing to certify against) is written in
        Lightning's own format instead, which `load_checkpoint` also reads;
        ``self.last_summary`` is then None.

        Args:
          checkpoint: the dict Lightning saves.
          path: a local path or fsspec URL.
          storage_options: fsspec options for a URL.

        Raises:
          CheckpointError: as `to_bytes`.
        """
        if any(not float(g["lr"]) > 0 for sd in checkpoint.get("optimizer_states", [])
               for g in sd.get("param_groups", [])):
            # lr 0 (the end of a schedule that decays to 0): nothing to certify against;
            # Lightning's own uncompressed format, which load_checkpoint also reads
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            data, self.last_summary = buf.getvalue(), None
        else:
            data, self.last_summary = self.to_bytes(checkpoint)
        if not storage.is_url(os.fspath(path)):
            os.makedirs(os.path.dirname(os.path.abspath(storage.local_path(path))), exist_ok=True)
        storage.atomic_write(os.fspath(path), data, storage_options=storage_options)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint written by `save_checkpoint` (all SHA-256 checks run).

        ``map_location`` and ``weights_only`` are accepted for Lightning's signature: tensors
        come back on the CPU (Lightning moves them when it loads the states), and nothing is
        ever unpickled.

        Args:
          path: a local path or fsspec URL.
          map_location: ignored for guarded containers (passed on for Lightning's format).
          weights_only: ignored for guarded containers (passed on for Lightning's format).

        Returns:
          The checkpoint dict, torch tensors for the tensors.

        Raises:
          FileNotFoundError: no object at `path` (what Lightning expects).
          ContainerError: the file is corrupt, truncated or not a jaxguard container.
        """
        path = os.fspath(path)
        if not storage.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        from torch_compat import restore_tree
        if storage.read_bytes(path)[:8] != b"JAXGUARD":  # an uncompressed checkpoint (lr 0, or not ours)
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        tree, header = restore_tree(path)
        self._check_resume(tree, header, path)
        return tree

    def _check_resume(self, tree, header, path) -> None:
        """Leave the one-shot kernel check (module docstring) for the optimizers of `tree`."""
        from torch_compat import state as tstate
        self.teardown()
        pending = []
        for i, sd in enumerate(tree.get("optimizer_states", []) if isinstance(tree, dict) else []):
            certified = tstate.certified_by_group(header, sd, prefix=f"optimizer_states/{i}")
            if any(certified):
                pending.append(([list(g.get("param_names") or ()) for g in sd["param_groups"]], certified, sd, i))
        if not pending:
            return

        def first_step(optimizer, args, kwargs):
            # torch iterates its hooks while calling this one: it is removed later (teardown)
            names = [list(g.get("param_names") or ()) for g in optimizer.param_groups]
            for item in [it for it in pending if it[0] == names]:
                pending.remove(item)
                tstate.warn_other_kernel(item[1], optimizer, str(path))
                tstate.check_next_update(header, item[2], optimizer.param_groups, str(path), strict=self.strict,
                                         prefix=f"optimizer_states/{item[3]}")

        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self._resume_check = register_optimizer_step_pre_hook(first_step)

    def teardown(self) -> None:
        """Drop a resume check no optimizer step has met yet (Lightning calls it when the
        strategy is torn down)."""
        if self._resume_check is not None:
            self._resume_check.remove()
            self._resume_check = None

    def remove_checkpoint(self, path) -> None:
        """Remove the checkpoint at `path`; a missing one is not an error.

        Args:
          path: a local path or fsspec URL.
        """
        storage.remove(os.fspath(path))
