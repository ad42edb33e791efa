"""`jaxguard compress|restore|inspect|verify` on every kind of input (`jaxguard.cli.inputs`).

One table says what each verb does with each kind: the verb's own work (a file: the
functions in `jaxguard.cli.main`; a DCP directory: `jaxguard.cli.dcp_verbs`; a trainer
directory: `jaxguard.cli.trainer_dirs`; a sharded or orbax directory: the sharded verbs
and the file verbs on the containers inside), or one line saying what the input is and
what reads it.  Every output names the kind it saw.
"""
from __future__ import annotations

__all__ = ["run"]

import argparse
import json

from jaxguard.errors import CheckpointError

JAX_DIRS = ("sharded", "orbax-item", "orbax-step")
TRAINER_DIRS = ("hf-checkpoint", "accelerate-checkpoint")
COMPRESSED_ALREADY = ("{path} is {what}: jaxguard wrote it, its Adam moments are compressed already; jaxguard inspect "
                      "and verify read it{restore}")
NOT_A_CONTAINER = ("{path} is {what}{not_container}: nothing to {verb}; jaxguard compress writes one from "
                   "a torch checkpoint")


def run(verb, a, *, file_verb, sharded_verb, torch_missing, print_summary, print_info) -> int:
    """Run `verb` on ``a.input`` (`jaxguard.cli.inputs.Input`).

    Args:
      verb: ``"compress"``, ``"restore"``, ``"inspect"`` or ``"verify"``.
      a: the parsed arguments, with ``input`` set.
      file_verb: the verb's function for a file (``a.ckpt``/``a.container`` a file).
      sharded_verb: ``(verb, a)`` for a `jaxguard.sharded` directory (inspect, verify).
      torch_missing: ``(what) -> one-line error or None`` when torch is not installed.
      print_summary, print_info: the CLI's printers (text or ``--json``).

    Returns:
      The exit status (0; 1 when verify fails).

    Raises:
      CheckpointError: the verb does not apply to the input (one line naming what it is).
    """
    inp = a.input
    path, what, kind = inp.path, inp.description, inp.kind
    if kind in ("container", "torch-file", "other-file"):
        if verb == "compress" and kind == "container":
            raise CheckpointError(COMPRESSED_ALREADY.format(path=path, what=what, restore=(
                "; jaxguard restore writes the torch checkpoint back")))
        if verb == "compress" and kind == "other-file":
            raise CheckpointError(f"{path} is {what}: jaxguard compress reads torch.save checkpoints, DCP directories "
                                  "and Hugging Face or accelerate checkpoint directories")
        if verb != "compress" and kind != "container":
            if verb == "verify":
                print(f"FAILED {path} ({what}): not a jaxguard container")
                return 1
            not_container = ", not a jaxguard container" if kind == "torch-file" else ""   # other-file's says it
            raise CheckpointError(NOT_A_CONTAINER.format(path=path, what=what, verb=verb, not_container=not_container))
        return file_verb(a)
    if kind == "dcp":
        missing = torch_missing(f"{verb} of a torch.distributed.checkpoint directory")
        if missing:
            raise CheckpointError(missing)
        from jaxguard.cli import dcp_verbs
        seen = {"input": what, "input_kind": kind}
        return dcp_verbs.run(verb, a, print_summary=lambda s, as_json: print_summary({**seen, **s}, as_json),
                             print_info=lambda info, as_json: print_info({"input": what, **info}, as_json))
    if kind in TRAINER_DIRS:    # (compress and restore checked torch before parsing; inspect, verify need none)
        from jaxguard.cli import trainer_dirs
        return trainer_dirs.run(verb, a, file_verb=file_verb, print_summary=print_summary, print_info=print_info)
    # JAX directories: compressed when written; read by inspect and verify
    if verb == "compress":
        raise CheckpointError(COMPRESSED_ALREADY.format(path=path, what=what, restore=(
            ", and jaxguard.load or orbax's GuardedRestore restore it into the structure of like")))
    if verb == "restore":
        raise CheckpointError(f"{path} is {what}: JAX state is restored by jaxguard.load(path, like=...) or orbax's "
                              "GuardedRestore, which give it the structure and shardings of like; jaxguard restore "
                              "writes torch checkpoints")
    if kind == "sharded":
        return sharded_verb(verb, a)
    if kind == "orbax-item":
        return _item(verb, a, inp.path, inp.names, file_verb, sharded_verb, what=what)
    return _step(verb, a, file_verb, sharded_verb, print_info)


def _with(a, path, inp) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(a), "container": path, "input": inp})


def _item(verb, a, path, names, file_verb, sharded_verb, *, what):
    """An orbax item directory of jaxguard's handler: its one container, or its sharded layout."""
    from jaxguard import sharded
    from jaxguard.format import storage
    if sharded.MANIFEST in names or any(n.startswith("process_") for n in names):
        return sharded_verb(verb, _with(a, path, a.input))
    files = [n for n in names if n.endswith(".jaxguard")]
    if len(files) != 1:
        raise CheckpointError(f"{path} is {what} holding {len(files)} .jaxguard files ({', '.join(files)}); "
                              f"pass one of them")
    inner = storage.join(path, files[0])
    return file_verb(_with(a, inner, a.input.inside(inner)))


def _step(verb, a, file_verb, sharded_verb, print_info):
    """An orbax step: the verb on each of its jaxguard items, one object per item with --json."""
    import contextlib
    import io
    from jaxguard.format import storage
    inp = a.input
    if not inp.items:
        others = [n for n in inp.names if storage.is_dir(storage.join(inp.path, n))]
        raise CheckpointError(f"{inp.path} is {inp.description} with no item written by jaxguard's "
                              f"GuardedCheckpointHandler (items: {', '.join(others) or 'none'}); jaxguard reads "
                              "those items only")
    status = 0
    found = {}
    for name in inp.items:
        item = storage.join(inp.path, name)
        names = tuple(sorted(storage.listdir(item)))
        sub = _with(a, item, inp.inside(item, "orbax-item", names))
        if verb == "inspect" and a.json:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                status |= _item(verb, sub, item, names, file_verb, sharded_verb, what=sub.input.description)
            found[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
            continue
        status |= _item(verb, sub, item, names, file_verb, sharded_verb, what=sub.input.description)
    if found:
        print(json.dumps({"input": inp.description, "input_kind": inp.kind, "items": found}, sort_keys=True))
    return status
