"""What a path given to the CLI is: the one place the verbs learn it.

`recognise(path)` looks at names only (a file's first 8 bytes; a directory's entries, and
its parent's for an orbax item) and returns an `Input` whose ``kind`` every verb
dispatches on and names in its output (``describe``).  A message never names a format the
input is not: what the path is not recognised as is said by what was looked for.

Kinds:

* ``container``: a jaxguard container file (magic ``JAXGUARD``).
* ``torch-file``: a zip archive or a pickle (``torch.save``'s two formats; the loader decides).
* ``other-file``: any other file.
* ``dcp``: a ``torch.distributed.checkpoint`` directory (``.metadata``, or rank files
  ``__R_S.distcp`` of a save that did not finish).
* ``sharded``: a `jaxguard.sharded` directory (``manifest.json``, or process files).
* ``orbax-item``: an orbax item directory written by `jaxguard.checkpoint`'s handler (its
  parent holds orbax's ``_CHECKPOINT_METADATA``; one ``*.jaxguard`` file or a sharded layout).
* ``orbax-step``: an orbax step directory (``_CHECKPOINT_METADATA``); ``items`` lists its
  jaxguard items.
* ``hf-checkpoint``: a Hugging Face Trainer ``checkpoint-N/`` (``trainer_state.json``, or
  ``optimizer.pt``/``optimizer.jg`` beside model weights).
* ``accelerate-checkpoint``: an ``Accelerator.save_state`` directory (``optimizer.bin``,
  ``optimizer_<i>.bin`` or ``optimizer*.jg`` beside ``random_states_*.pkl`` or model weights).
"""
from __future__ import annotations

__all__ = ["DESCRIPTIONS", "WEIGHT_FILES", "Input", "describe", "recognise", "guard_spec", "param_order"]

import re
from typing import NamedTuple

from jaxguard.errors import CheckpointError

DESCRIPTIONS = {
    "container": "a jaxguard container file",
    "torch-file": "a torch.save checkpoint file",
    "other-file": "a file that is neither a jaxguard container nor a torch.save checkpoint",
    "dcp": "a torch.distributed.checkpoint directory",
    "sharded": "a jaxguard sharded checkpoint directory",
    "orbax-item": "an orbax item directory of jaxguard's GuardedCheckpointHandler",
    "orbax-step": "an orbax checkpoint step directory",
    "hf-checkpoint": "a Hugging Face Trainer checkpoint directory",
    "accelerate-checkpoint": "an accelerate save_state directory",
}
ORBAX_STEP_FILE = "_CHECKPOINT_METADATA"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
                "adapter_model.safetensors", "adapter_model.bin")
_HF_OPTIMIZER = re.compile(r"optimizer\.(pt|jg)$")
_ACCELERATE_OPTIMIZER = re.compile(r"optimizer(_\d+)?\.(bin|jg)$")
_DISTCP = re.compile(r"__\d+_\d+\.distcp$")


class Input(NamedTuple):
    """A CLI input: its kind (a key of `DESCRIPTIONS`), its path and what was found in it."""

    kind: str
    path: str
    names: tuple = ()     # a directory's entries
    items: tuple = ()     # orbax-step: its jaxguard item directories
    within: str = ""      # the input the verb was given, when this one lies inside it

    @property
    def description(self) -> str:
        """Returns: the kind in words (``"a Hugging Face Trainer checkpoint directory"``), and
        what it lies in when the verb was given a directory around it."""
        return DESCRIPTIONS[self.kind] + (f" in {self.within}" if self.within else "")

    def inside(self, path, kind="container", names=()) -> "Input":
        """An input inside this one (an orbax item's container, a trainer directory's file).

        Args:
          path: its path.
          kind: its kind.
          names: its entries (a directory).

        Returns:
          The `Input`, whose description names this one.
        """
        return Input(kind, str(path), tuple(names), (), self.within or f"{self.path} ({self.description})")

    def optimizer_files(self) -> list:
        """Returns: a trainer directory's optimizer files (``optimizer.pt``, ``optimizer_1.bin``,
        ``optimizer.jg``, ...), sorted."""
        pattern = _HF_OPTIMIZER if self.kind == "hf-checkpoint" else _ACCELERATE_OPTIMIZER
        return sorted(n for n in self.names if pattern.fullmatch(n))


def describe(inp: Input) -> str:
    """The line a verb prints first: ``input: PATH is <kind in words>``.

    Args:
      inp: from `recognise`.

    Returns:
      The line.
    """
    return f"input: {inp.path} is {inp.description}"


def _jaxguard_item(names) -> bool:
    from jaxguard import sharded
    return any(n.endswith(".jaxguard") for n in names) or sharded.MANIFEST in names


def recognise(path) -> Input:
    """The kind of `path` (module docstring).

    Args:
      path: a local path or an fsspec URL.

    Returns:
      The `Input`.

    Raises:
      CheckpointError: nothing at `path`, or a directory of no kind above (one line naming
        what was looked for).
    """
    from jaxguard.format import storage
    path = str(path)
    if not storage.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if not storage.is_dir(path):
        head = storage.read_range(path, 0, min(8, storage.size(path)))
        if head == b"JAXGUARD":
            return Input("container", path)
        # torch.save: a zip archive ("PK\x03\x04"), or the legacy format's pickle (protocol opcode 0x80)
        return Input("torch-file" if head.startswith((b"PK\x03\x04", b"\x80")) else "other-file", path)
    names = tuple(sorted(storage.listdir(path)))
    if ".metadata" in names or any(_DISTCP.fullmatch(n) for n in names):
        return Input("dcp", path, names)
    if ORBAX_STEP_FILE in names:
        items = tuple(n for n in names if storage.is_dir(storage.join(path, n))
                      and _jaxguard_item(storage.listdir(storage.join(path, n))))
        return Input("orbax-step", path, names, items)
    parent = _parent(path)
    if _jaxguard_item(names) and parent is not None and storage.exists(storage.join(parent, ORBAX_STEP_FILE)):
        return Input("orbax-item", path, names)
    from jaxguard import sharded
    if sharded.MANIFEST in names or any(n.startswith("process_") and n.endswith(".jaxguard") for n in names):
        return Input("sharded", path, names)
    has_weights = any(n in WEIGHT_FILES for n in names)
    # accelerate's save_state writes random_states_<i>.pkl; the Trainer, rng_state*.pth (an
    # optimizer.jg beside weights is either's once compressed: these tell them apart)
    accelerate_rng = any(n.startswith("random_states_") for n in names)
    if "trainer_state.json" in names or (
            has_weights and not accelerate_rng and any(_HF_OPTIMIZER.fullmatch(n) for n in names)):
        return Input("hf-checkpoint", path, names)
    if any(_ACCELERATE_OPTIMIZER.fullmatch(n) for n in names) and (has_weights or accelerate_rng):
        return Input("accelerate-checkpoint", path, names)
    if any(n.endswith(".jaxguard") for n in names):       # a handler item directory copied out of its step
        return Input("orbax-item", path, names)
    steps = [n for n in names if storage.exists(storage.join(path, n, ORBAX_STEP_FILE))]
    if steps:
        raise CheckpointError(f"{path} is an orbax CheckpointManager directory (steps {', '.join(steps[:5])}"
                              f"{', ...' if len(steps) > 5 else ''}): pass one step, e.g. "
                              f"{storage.join(path, steps[-1])}")
    raise CheckpointError(f"{path} is a directory jaxguard does not recognise: none of a DCP .metadata, a sharded "
                          f"manifest.json, orbax's {ORBAX_STEP_FILE} or an opt_state.jaxguard item, a Hugging Face "
                          "trainer_state.json, or optimizer.pt/.bin/.jg beside model weights is in it")


def _parent(path: str):
    import os
    import posixpath
    from jaxguard.format import storage
    if storage.is_url(path):
        parent = posixpath.dirname(path.rstrip("/"))
        return parent if "://" in parent and parent != path.rstrip("/") else None
    parent = os.path.dirname(os.path.abspath(path))
    return parent if parent != os.path.abspath(path) else None


def guard_spec(a):
    """The `jaxguard.GuardSpec` the compress flags ask for (``--tau``, ``--clip``, ``--codec``,
    ``--bound``, ``--partition``; an absent flag keeps the default).

    Args:
      a: the parsed CLI arguments.

    Returns:
      The checked `GuardSpec` (`jaxguard.core.config.save_spec`).
    """
    from jaxguard.core.config import save_spec   # jax: only the verbs that compress pay for it
    return save_spec(None, tau=a.tau, clip=a.clip, codec=a.codec, bound=a.bound, partition=a.partition)


def param_order(value):
    """``--param-order``: ``model``, or a file of parameter names (one a line, in the
    optimizer's order; blank lines and ``#`` comments skipped); None when not given.

    Args:
      value: the option's value or None.

    Returns:
      None, ``"model"`` or a list of names.

    Raises:
      CheckpointError: the file cannot be read.
    """
    if value is None or value == "model":
        return value
    if value == "trainer":
        raise CheckpointError("--param-order trainer applies to a Hugging Face Trainer checkpoint directory "
                              "(checkpoint-N/, whose config.json names the model); pass 'model' or a file of names")
    try:
        with open(value) as fh:
            return [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
    except OSError as exc:
        raise CheckpointError(f"--param-order {value}: {exc.strerror or exc}; pass 'model' or a file of parameter "
                              "names, one a line, in the optimizer's order") from None
