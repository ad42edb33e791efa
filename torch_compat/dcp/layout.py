"""What a guarded DCP checkpoint holds and where: the manifest key, the shard items'
names, the moments guarded, and the small helpers both planners share."""
from __future__ import annotations

__all__ = ['FORMAT', 'MANIFEST_KEY', 'SHARD_PREFIX', 'MOMENTS', 'NOT_GUARDED', 'manifest_of', 'one_line',
           'optimizer_roots', 'group_of', 'offsets_key', 'chunk_items', 'tensor_sha256']

import hashlib

import torch

from torch.distributed.checkpoint.planner_helpers import _create_write_items
from jaxguard.errors import CheckpointError
from torch_compat.dcp_metadata import check_manifest


FORMAT = "jaxguard-dcp/1"
MANIFEST_KEY = "__jaxguard__"
SHARD_PREFIX = "__jaxguard__/"
MOMENTS = ("exp_avg", "exp_avg_sq")
NOT_GUARDED = ("{path} is a plain DCP checkpoint (no jaxguard manifest); convert it with "
               "`jaxguard compress {path} -o DIR2` first")


# ---------------------------------------------------------------- small helpers
def offsets_key(fqn, offsets) -> str:
    """The manifest's key of a DCP item: ``fqn``, or ``fqn@o0,o1,...`` for a shard at `offsets`.

    Args:
      fqn: the item's fully qualified name.
      offsets: the shard's offsets (empty or None for a whole tensor).
    """
    return fqn if offsets is None else f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def tensor_sha256(t: torch.Tensor) -> str:
    """The SHA-256 hex digest of a tensor's bytes (on the CPU, contiguous).

    Args:
      t: the tensor.
    """
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() if t.numel() else \
        hashlib.sha256(b"").hexdigest()


def one_line(exc) -> str:
    """The first line of an exception's message (its type's name if empty), at most 200 characters.

    Args:
      exc: the exception.
    """
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def optimizer_roots(nested) -> dict:
    """{path tuple: optimizer state_dict} for every dict holding 'state' and 'param_groups'.

    Args:
      nested: the nested state_dict DCP saves or loads.
    """
    out = {}

    def walk(obj, path):
        if isinstance(obj, dict):
            if isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), (list, tuple)):
                out[path] = obj
                return
            for k, v in obj.items():
                walk(v, path + (k,))

    walk(nested, ())
    return out


def group_of(osd, fqn, root):
    """``(index, param group)`` of `osd` that lists `fqn`.

    Args:
      osd: an optimizer state_dict (`optimizer_roots`).
      fqn: the parameter's fully qualified name.
      root: the state_dict's path, for the error.

    Raises:
      CheckpointError: no group lists it.
    """
    for gi, g in enumerate(osd["param_groups"]):
        if fqn in list(g.get("params", ())):
            return gi, g
    raise CheckpointError(f"optimizer state {'.'.join(map(str, root))}.state[{fqn!r}] belongs to no param group; "
                          "save the optimizer state_dict from get_state_dict(model, optimizer)")


def chunk_items(fqn, obj):
    """[(offsets, sizes, MetadataIndex)] of the local chunks DCP would write for `obj`.

    Args:
      fqn: the item's fully qualified name.
      obj: its value (a tensor or a DTensor).
    """
    return [(tuple(int(o) for o in it.tensor_data.chunk.offsets), tuple(int(s) for s in it.tensor_data.chunk.sizes),
             it.index) for it in _create_write_items(fqn, obj)]


def manifest_of(metadata):
    """The jaxguard manifest recorded in DCP `metadata`.

    Args:
      metadata: a DCP `Metadata`.

    Returns:
      The manifest dict, or None for a plain DCP checkpoint.

    Raises:
      CheckpointError: a manifest of another format version.
    """
    pd = getattr(metadata, "planner_data", None)
    man = pd.get(MANIFEST_KEY) if isinstance(pd, dict) else None
    if man is None:
        return None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"the checkpoint's jaxguard manifest is {str(man.get('format') if isinstance(man, dict) else man)[:40]!r}, "
                              f"this version reads {FORMAT!r}; upgrade jaxguard")
    check_manifest(man, metadata)
    return man
