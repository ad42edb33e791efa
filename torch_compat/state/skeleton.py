"""A checkpoint's tree as a JSON skeleton plus raw arrays (nothing pickled), and back."""
from __future__ import annotations

__all__ = ['to_skeleton', 'from_skeleton', 'tie_key']

import argparse
import math

import numpy as np

from jaxguard.format import container, reader
from jaxguard.format.torchzip import FileTensor
from jaxguard.errors import CheckpointError
from torch_compat.state.tensors import writable_array, is_tensor, numpy_to_tensor, tensor_to_numpy, torch


def tie_key(t):
    """What makes two tensors the same stored values: one storage, offset, shape, strides
    and dtype (a tied weight under two state_dict keys); None for an empty tensor.

    Args:
      t: a tensor.
    """
    if t.numel() == 0:
        return None
    if isinstance(t, FileTensor):
        return ("file", t.key, t.offset, t.shape, t.stride, t.dtype_name)
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def to_skeleton(obj, path, raws, tied=None):
    """A checkpoint object as a JSON skeleton, its tensors appended to `raws` as raw entries.

    A tensor that is the very same view of one storage as a tensor met before (a tied
    weight, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) is stored once:
    its node names the first one's entry, as ``torch.save`` keeps one storage for both.

    Args:
      obj: tensors, dicts (str/int keys), lists, tuples, numbers, strings, None, numpy
        arrays and scalars, ``argparse.Namespace``.
      path: the entry-name prefix of `obj` (``"model"``, ``"optimizer/state/0"``).
      raws: the list the `container.Raw` records are appended to.
      tied: ``{tensor identity: entry name}`` shared by the calls of one checkpoint
        (None: a fresh one for `obj`).

    Returns:
      The skeleton (``{"__tensor__": name}``, ``{"__dict__": [[k, v], ...]}``, ...).

    Raises:
      CheckpointError: a key or value of a type the container cannot hold.
    """
    tied = {} if tied is None else tied
    if is_tensor(obj):
        key = tie_key(obj)
        if key is not None and key in tied:
            return {"__tensor__": tied[key]}
        arr, dt = tensor_to_numpy(obj)
        raws.append(container.Raw(path, arr, dt))
        if key is not None:
            tied[key] = path
        return {"__tensor__": path}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"key {k!r} under {path!r} is a {type(k).__name__}; only str and int keys can be stored")
            items.append([k, to_skeleton(v, f"{path}/{k}", raws, tied)])
        return {"__dict__": items}
    if isinstance(obj, (list, tuple)):
        tag = "__list__" if isinstance(obj, list) else "__tuple__"
        return {tag: [to_skeleton(v, f"{path}/{i}", raws, tied) for i, v in enumerate(obj)]}
    if isinstance(obj, (np.ndarray, np.generic)) and not isinstance(obj, np.str_):
        # numpy values as checkpoints hold them (best_val_loss=np.float64(...), np.random.get_state()'s
        # uint32 key): raw entries, restored with their type, shape and bits
        arr = np.ascontiguousarray(obj)
        raws.append(container.Raw(path, arr, container.numpy_dtype_name(arr)))
        return {"__ndarray__" if isinstance(obj, np.ndarray) else "__npscalar__": path}
    if isinstance(obj, argparse.Namespace):   # a run's arguments
        return {"__namespace__": to_skeleton(vars(obj), path, raws, tied)["__dict__"]}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"{path!r} holds a {type(obj).__name__}; jaxguard stores tensors, numbers, strings, "
                          "lists, tuples, dicts, numpy arrays and scalars and argparse.Namespace (convert it, or keep "
                          "it outside the checkpoint)")


def from_skeleton(sk, arrays, dtypes):
    """Rebuild the object of a `to_skeleton` skeleton.

    Args:
      sk: the skeleton (from the container's meta).
      arrays: {entry name: array or (m~, v~)} (`container.entries_by_name`).
      dtypes: {entry name: dtype name}.

    Returns:
      The object, tensors as CPU tensors.

    Raises:
      CheckpointError: the skeleton names an entry the container does not hold.
    """
    if isinstance(sk, dict):
        reader.skeleton_ref(sk, arrays)
        if "__tensor__" in sk:   # an entry named twice (a tied weight) restores from one array
            return numpy_to_tensor(arrays[sk["__tensor__"]], dtypes[sk["__tensor__"]])
        if "__moment__" in sk:
            m, v = arrays[sk["__moment__"]]
            return torch.from_numpy(writable_array(m if sk["which"] == "m" else v))
        if "__dict__" in sk:
            return {k: from_skeleton(v, arrays, dtypes) for k, v in sk["__dict__"]}
        if "__list__" in sk:
            return [from_skeleton(v, arrays, dtypes) for v in sk["__list__"]]
        if "__tuple__" in sk:
            return tuple(from_skeleton(v, arrays, dtypes) for v in sk["__tuple__"])
        if "__float__" in sk:
            return float(sk["__float__"])
        if "__ndarray__" in sk or "__npscalar__" in sk:
            name = sk.get("__ndarray__", sk.get("__npscalar__"))
            arr = np.array(arrays[name])
            if dtypes[name] == "bfloat16":
                import ml_dtypes
                arr = arr.view(ml_dtypes.bfloat16)
            return arr if "__ndarray__" in sk else arr.reshape(())[()]
        if "__namespace__" in sk:
            return argparse.Namespace(**{k: from_skeleton(v, arrays, dtypes) for k, v in sk["__namespace__"]})
    return sk
