"""`quantized(tx, policy)`: keep any optax optimizer's state quantized between steps.

Each step decodes the stored state, runs the inner transformation in float32 and encodes
the new state again (decode -> inner update -> encode).  Which state tensors are encoded,
and with which code, is a pure function of the state's tree paths and the parameters'
paths and shapes (a *plan*), so ``init`` and ``update`` always agree and ``jit`` sees one
static structure.

Per-state precision policy
--------------------------
A state leaf is addressed by its *field*: the name of the innermost NamedTuple attribute on
its path (``mu``, ``nu`` for ``optax.scale_by_adam``; ``v_row``, ``v_col``, ``v`` for
``optax.scale_by_factored_rms``; ``mu``, ``v_row``... for :func:`jaxguard.quant.came`).
Fields are known to be non-negative (``NONNEGATIVE_FIELDS``) or signed (``SIGNED_FIELDS``).

* ``"al8"``  non-negative -> AL8, signed -> uf8 (the paper's AdamW configuration)
* ``"al16"`` non-negative -> AL16, signed -> uf8
* ``"d8"``   non-negative -> unsigned dynamic map, signed -> signed dynamic map (bitsandbytes)
* ``"fp32"`` nothing encoded
* a mapping ``{field: code}``, optionally with the keys ``"nonnegative"`` and ``"signed"``
  as defaults; codes are ``fp32, bf16, al8, al16, uf8, d8``.  Fields of unknown sign are
  left in float32 unless named.

Topology-aware protection
-------------------------
``protect=True`` (default) routes a parameter's states to ``protected_policy`` (default
``"fp32"``) when the *parameter* is 1-D or 0-D, or its path matches ``protect_patterns``
(norms, biases, embeddings, LM head).  ``protect=False`` is the paper's "bare" setting.
A callable ``protect(path: str, shape) -> bool`` replaces the rule.  Parameters with fewer
than ``min_size`` elements are never encoded (bitsandbytes' ``min_8bit_size``); note the
test is on the parameter, so the small ``v_row``/``v_col`` of a large matrix are encoded.

Numerical contract: each encoded leaf obeys its codec's contract
(:mod:`jaxguard.quant.codecs`); everything else is the inner optimizer's float32 arithmetic.
NaN/Inf in an encoded state are reset to 0 at encode time (as bitsandbytes does).  XLA on
CPU flushes subnormal float32 results to zero inside the inner update: a second moment
below 2**-126 (|g| below ~1e-19) is already 0 in FP32 on CPU, before any encoding.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxguard.core import codes as _codes
from jaxguard.errors import ConfigError
from jaxguard.optax_state import key_str
from jaxguard.quant import codecs

__all__ = ["quantized", "QuantizedState", "state_bytes", "plan", "NONNEGATIVE_FIELDS",
           "SIGNED_FIELDS", "DEFAULT_PROTECT_PATTERNS", "PRESETS"]

NONNEGATIVE_FIELDS = frozenset({
    "nu", "v", "v_row", "v_col", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col",
    "res_row", "res_col", "sum_of_squares", "grad_sq",
})
SIGNED_FIELDS = frozenset({"mu", "m", "exp_avg", "ema", "trace", "momentum"})

DEFAULT_PROTECT_PATTERNS = (
    r"norm", r"(^|[/._\[\]'])ln", r"bias", r"embed", r"wte", r"wpe", r"tok_emb", r"pos_emb",
    r"lm_head", r"unembed", r"(^|[/._\[\]'])head",
)

PRESETS = {
    "fp32": {"nonnegative": "fp32", "signed": "fp32"},
    "al8": {"nonnegative": "al8", "signed": "uf8"},
    "al16": {"nonnegative": "al16", "signed": "uf8"},
    "d8": {"nonnegative": "d8", "signed": "d8"},
}

Policy = Union[str, Mapping[str, str]]


class QuantizedState(NamedTuple):
    """The inner optimizer's state with chosen leaves replaced by encoded NamedTuples."""
    inner: Any


# ------------------------------------------------------------------ policy
def _resolve_policy(policy: Policy) -> dict:
    if isinstance(policy, str):
        if policy not in PRESETS:
            raise ConfigError(f"policy={policy!r} is unknown; use one of {', '.join(PRESETS)} "
                              f"or a mapping field -> code")
        return dict(PRESETS[policy])
    if not isinstance(policy, Mapping):
        raise ConfigError(f"policy={policy!r} is neither a preset name nor a mapping field -> code")
    out = {"nonnegative": "fp32", "signed": "fp32"}
    for k, v in policy.items():
        out[k] = v
    for k, v in out.items():
        if v not in codecs.CODE_NAMES:
            raise ConfigError(f"policy[{k!r}]={v!r} is not a code; use one of {', '.join(codecs.CODE_NAMES)}")
        if v in ("al8", "al16") and (k == "signed" or k in SIGNED_FIELDS):
            raise ConfigError(f"policy[{k!r}]={v!r}: AL codes are for non-negative states; use 'uf8' or 'd8'")
    return out


def _code_for(field: str | None, pol: dict) -> str:
    if field is not None and field in pol:
        return pol[field]
    if field in NONNEGATIVE_FIELDS:
        return pol["nonnegative"]
    if field in SIGNED_FIELDS:
        return pol["signed"]
    return "fp32"


# ------------------------------------------------------------------ paths
def _path_str(path) -> str:
    return "/".join(key_str(k) for k in path)


def _split_state_path(path):
    """(field, param_path_str) for a state leaf path: the field is the last GetAttrKey."""
    idx = None
    for i, k in enumerate(path):
        if isinstance(k, jax.tree_util.GetAttrKey):
            idx = i
    if idx is None:
        return None, _path_str(path)
    return path[idx].name, _path_str(path[idx + 1:])


def _default_protect(patterns):
    rx = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)

    def protect(path: str, shape) -> bool:
        return len(shape) <= 1 or bool(rx.search(path))
    return protect


def plan(state, params, policy: Policy = "al8", *, protect: Union[bool, Callable] = True,
         protected_policy: Policy = "fp32", min_size: int = 4096,
         protect_patterns=DEFAULT_PROTECT_PATTERNS):
    """The code each state leaf gets: a pytree like ``state`` holding code names.

    ``params`` may be any tree with the parameters' paths and shapes (arrays or
    ``jax.ShapeDtypeStruct``).  Useful to inspect what ``quantized`` will do.

    Args:
      state: the inner optimizer's state (e.g. ``tx.init(params)``).
      params: a tree with the parameters' paths and shapes.
      policy: a preset name (`PRESETS`: "fp32", "al8", "d8", ...) or a mapping from
        ``"nonnegative"``/``"signed"``/a state field name to a code.
      protect: True (leaves whose parameter path matches `protect_patterns`, and 0/1-D
        parameters, get `protected_policy`), False, or a callable ``(path, shape) -> bool``.
      protected_policy: the policy of protected leaves (default fp32).
      min_size: parameters with fewer elements stay fp32 (bitsandbytes' 4096).
      protect_patterns: regexes (case-insensitive) of protected parameter paths.

    Returns:
      A pytree of ``state``'s structure whose leaves are code names (non-floating and
      scalar leaves: ``"fp32"``).

    Raises:
      ConfigError: an unknown policy or code, a bad ``protect`` or ``min_size``.
    """
    pol = _resolve_policy(policy)
    ppol = _resolve_policy(protected_policy)
    if protect is True:
        prot = _default_protect(protect_patterns)
    elif protect is False or protect is None:
        prot = lambda path, shape: False  # noqa: E731
    elif callable(protect):
        prot = protect
    else:
        raise ConfigError(f"protect={protect!r} must be True, False or a callable (path, shape) -> bool")
    if not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ConfigError(f"min_size={min_size!r} must be a non-negative int (bitsandbytes uses 4096)")
    pshapes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        pshapes[_path_str(path)] = tuple(np.shape(leaf))

    def choose(path, leaf):
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating) or np.ndim(leaf) == 0:
            return "fp32"
        field, ppath = _split_state_path(path)
        pshape = pshapes.get(ppath, tuple(np.shape(leaf)))
        if math.prod(pshape) < min_size:
            return "fp32"
        use = ppol if prot(ppath, pshape) else pol
        return _code_for(field, use)

    return jax.tree_util.tree_map_with_path(choose, state)


# ------------------------------------------------------------------ wrapper
def _encode_leaf(x, code, block_size, field_signed):
    if code == "fp32":
        return x
    if code == "d8":
        return codecs.d8_encode(x, signed=field_signed, block_size=block_size)
    return codecs.quantize(x, code, block_size)


def _decode_tree(qstate):
    return jax.tree_util.tree_map(lambda e: codecs.dequantize(e) if codecs.is_encoded(e) else e,
                                  qstate, is_leaf=codecs.is_encoded)


def quantized(tx: optax.GradientTransformation, policy: Policy = "al8", *,
              protect: Union[bool, Callable] = True, protected_policy: Policy = "fp32",
              min_size: int = 4096, block_size: int = _codes.BLOCK,
              protect_patterns=DEFAULT_PROTECT_PATTERNS) -> optax.GradientTransformation:
    r"""Wrap ``tx`` so that its state is stored encoded between steps.

    .. math::  s_t = E(\mathrm{tx.update}(g_t, D(s_{t-1}), p_t)), \quad s_0 = E(\mathrm{tx.init}(p_0))

    with :math:`E`/:math:`D` the per-leaf encoder/decoder chosen by :func:`plan`.  The
    returned updates are exactly the inner optimizer's updates computed from the decoded
    state.  ``init`` and ``update`` are jittable; ``update`` needs the gradient tree to
    have the parameters' paths (it always does in optax).

    Args:
      tx: the inner optax transformation.
      policy, protect, protected_policy, min_size, protect_patterns: as `plan`.
      block_size: values per block of the blocked codes (a power of two).

    Returns:
      An ``optax.GradientTransformation`` whose state is a `QuantizedState`.

    Raises:
      ConfigError: an unknown policy or a bad block_size (at once), or as `plan` (at
        ``init``).
    """
    _resolve_policy(policy)
    _resolve_policy(protected_policy)
    codecs.check_block_size(block_size)
    kw = dict(protect=protect, protected_policy=protected_policy, min_size=min_size,
              protect_patterns=protect_patterns)

    def encode_tree(state, params_like):
        p = plan(state, params_like, policy, **kw)

        def enc(path, x, code):
            field, _ = _split_state_path(path)
            return _encode_leaf(x, code, block_size, field not in NONNEGATIVE_FIELDS)
        return jax.tree_util.tree_map_with_path(enc, state, p)

    def init_fn(params):
        return QuantizedState(encode_tree(tx.init(params), params))

    def update_fn(updates, state, params=None):
        inner = _decode_tree(state.inner)
        new_updates, new_inner = tx.update(updates, inner, params)
        return new_updates, QuantizedState(encode_tree(new_inner, updates))

    return optax.GradientTransformation(init_fn, update_fn)


def state_bytes(state) -> int:
    """Actual bytes of every array leaf in ``state`` (codes, scales, counters, all).

    Args:
      state: any pytree (a `QuantizedState`, a plain optax state, ...).

    Returns:
      The sum of ``size * itemsize`` over the leaves (int).
    """
    total = 0
    for leaf in jax.tree_util.tree_leaves(state):
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
            total += int(math.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        else:
            total += np.asarray(leaf).nbytes
    return total
