"""What to certify: a static `GuardSpec` (compile-time) and the per-step constants.

`GuardConfig` is the public constructor (and what container headers store, via
`to_json`/`from_json`).  `NextUpdate` is the typed value of what a save certifies for:
the next update's learning rate (a number, or an interval ``(lo, hi)`` certified for every
rate in it), step, betas, eps, weight decay, op model and where they came from;
`UpdateRequest` is what a save was told about it before it is resolved per group.  It splits into ``cfg.spec``, a hashable `GuardSpec` (codec,
bound, partition, op model, tau, clip, joint, certify: a jit static argument), and
``cfg.constants()``, the `opmodel.StepConstants` of the next update (lr, step, betas,
eps, weight decay); ``cfg.step_row()`` packs those with tau as the certificate's
float32 `bound.StepRow`, which a jitted save hook takes as a traced argument so that a
new step or learning rate does not recompile.
"""
from __future__ import annotations

__all__ = ["CODECS", "DEFAULT_CODEC", "BOUNDS", "PARTITIONS", "GuardSpec", "is_interval", "lr_bounds",
           "check_lr_interval", "NextUpdate", "UpdateRequest", "GuardConfig", "save_spec"]

import dataclasses
from typing import Any

import numpy as np

from jaxguard.core import bound as _bound
from jaxguard.core.opmodel import OP_MODELS, StepConstants, f32, step_constants
from jaxguard.errors import ConfigError
from jaxguard.format import spec as _spec

CODECS = _spec.codec_ids()   # the registry's writable ids
DEFAULT_CODEC = _spec.DEFAULT_CODEC   # defined once, in the registry
BOUNDS = ("shared", "separate")
PARTITIONS = ("mixed", "linear")
# A policy id kept for the CLI, the demo, the bench and old files: block8 codes with the
# guard off.  The container entry keeps this id, so readers know nothing was certified.
UNGUARDED_ALIASES = {"block8-unguarded": "block8"}
# Ids whose codes are another codec's, stored differently: they propose and certify as it.
STORAGE_ALIASES = {"log8-rel-zstd": "log8-rel"}


@dataclasses.dataclass(frozen=True)
class GuardSpec:
    """The static part of a guard configuration: hashable, a jit static argument.

    Attributes:
      codec: the codec id as stored in the container entry (``block8-unguarded`` included).
      bound, partition: the certificate ('shared'/'separate', 'mixed'/'linear').
      op_model: the operation model the guarantee is stated against.
      tau, clip: the contract (``|p1' - p2'| <= tau*lr`` for every ``|g| <= clip``).
      joint: search neighbouring code pairs for escaped coordinates.
      certify: False skips the guard (no guarantee; only non-certifiable inputs escape).
    """

    codec: str = DEFAULT_CODEC
    bound: str = _spec.DEFAULT_BOUND
    partition: str = _spec.DEFAULT_PARTITION
    op_model: str = "torch-adam"
    tau: float = _spec.DEFAULT_TAU
    clip: float = _spec.DEFAULT_CLIP
    joint: bool = False
    certify: bool = True

    @property
    def decode_codec(self) -> str:
        """The codec whose codes and decode this spec uses (block8 for block8-unguarded,
        log8-rel for log8-rel-zstd)."""
        return UNGUARDED_ALIASES.get(self.codec, STORAGE_ALIASES.get(self.codec, self.codec))


# Where a save's hyperparameters came from (`NextUpdate.source`), as entries record it.
SOURCES = {
    "given": "the save's arguments (lr=, weight_decay=, betas=, eps=), not checked against the optimizer",
    "tx": "read from the optax transformation by evaluating tx.update on probe states (jaxguard.optax_probe)",
    "given+tx": "the save's arguments, checked against the optax transformation",
    "param_groups": "the torch optimizer's param_groups (its next step's hyperparameters)",
    "param_groups+given": "the torch optimizer's param_groups with the learning rate given to the save",
}


def is_interval(lr) -> bool:
    """Whether `lr` is a learning-rate interval: a tuple or list of two real numbers.

    Args:
      lr: anything given as a learning rate.

    Returns:
      True for ``(lo, hi)`` / ``[lo, hi]`` of two numbers (bools excluded).
    """
    return (isinstance(lr, (tuple, list)) and len(lr) == 2
            and all(isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool) for x in lr))


def lr_bounds(lr) -> tuple:
    """``(lo, hi)`` of a learning rate given as a number or an interval (`is_interval`).

    Args:
      lr: a number or ``(lo, hi)``.

    Returns:
      ``(float(lo), float(hi))``; ``(lr, lr)`` for a number.
    """
    if is_interval(lr):
        return float(lr[0]), float(lr[1])
    return float(lr), float(lr)


def check_lr_interval(lr, weight_decay=0.0) -> None:
    """Check an interval learning rate against what `bound.pack_interval` needs.

    Args:
      lr: ``(lo, hi)``.
      weight_decay: the weight decay of the same update.

    Raises:
      ConfigError: (one line) ``lo`` not > 0 in float32, ``lo > hi``, ``hi > 1`` or
        ``hi * weight_decay > 1`` (the bound's terms are then not of the form the
        interval row covers: docs/bound.md, section 10).
    """
    lo, hi = lr_bounds(lr)
    if not (np.isfinite(lo) and np.isfinite(hi)) or not f32(lo) > 0:
        raise ConfigError(f"lr={tuple(lr)!r}: an interval needs 0 < lo <= hi in float32; for a next update at lr 0 "
                          "pass lr=0.0 (the moments are then stored exactly)")
    if lo > hi:
        raise ConfigError(f"lr={tuple(lr)!r} has lo > hi; pass (lo, hi) with lo <= hi")
    if hi > 1:
        raise ConfigError(f"lr={tuple(lr)!r}: an interval is certified for hi <= 1 only (docs/bound.md, section 10); "
                          "certify one learning rate above 1 at a time")
    if hi * float(weight_decay) > 1:
        raise ConfigError(f"lr={tuple(lr)!r} with weight_decay={weight_decay!r}: an interval is certified for "
                          "hi * weight_decay <= 1 only (docs/bound.md, section 10); narrow the interval")


@dataclasses.dataclass(frozen=True)
class NextUpdate:
    """What a save certifies for: the hyperparameters of the first update after restoring.

    Frozen and hashable (a jit static value where needed); one per parameter group.

    Attributes:
      lr: the next update's learning rate: a number > 0, or an interval ``(lo, hi)``
        (``0 < lo <= hi <= 1``, ``hi * weight_decay <= 1``) certified for every rate in it.
      step: the optimizer's step count at the checkpoint (the update's bias corrections
        are at ``step + 1``).
      betas, eps, weight_decay: the update's.
      op_model: the operation model (`jaxguard.core.opmodel.OP_MODELS`).
      source: where the hyperparameters came from (a key of `SOURCES`).
    """

    lr: Any
    step: int
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    op_model: str = "torch-adam"
    source: str = "given"

    def __post_init__(self):
        if is_interval(self.lr):
            lo, hi = lr_bounds(self.lr)
            object.__setattr__(self, "lr", lo if lo == hi else (lo, hi))
            if lo != hi:
                check_lr_interval(self.lr, self.weight_decay)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.source not in SOURCES:
            raise ConfigError(f"source={self.source!r} is unknown; use one of {', '.join(SOURCES)}")

    @property
    def lr_interval(self) -> tuple:
        """``(lo, hi)`` (``lo == hi`` for one learning rate)."""
        return lr_bounds(self.lr)

    @property
    def stores_exactly(self) -> bool:
        """The next update's learning rate is 0 in float32 (warmup from zero, a schedule
        that ends at 0): a guarantee in units of lr says nothing there, so the moments
        are stored exactly instead of certified (docs/format.md)."""
        return not is_interval(self.lr) and f32(float(self.lr)) == 0

    def to_json(self) -> dict:
        """The fields as JSON (an interval lr as ``[lo, hi]``)."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        if is_interval(self.lr):
            d["lr"] = list(self.lr)
        return d


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateRequest:
    """What a save is told about the next update, before it is resolved per parameter
    group into a `NextUpdate` (the value each entry records): the one value the
    hyperparameters travel in below the public edge (`jaxguard.save`, `torch_compat.save`,
    the orbax args, the jit hook and the integrations keep the keywords users pass and
    build one); the guard settings travel apart, as the `GuardSpec`.

    Frozen; compared by identity (a schedule or a pytree of rates is no hashable value).

    Attributes:
      lr: the next update's learning rate: None (read from the optimizer where it can
        be), a number, an optax schedule (evaluated at each state's count), an interval
        ``(lo, hi)``, or a pytree prefix of the params of those (optax); a number or
        interval for every group (torch).
      weight_decay, betas, eps: optax: overrides of what the state records (None: the
        state's, ``inject_hyperparams``' or optax's defaults; `weight_decay` may be a
        pytree prefix too).  torch reads them from ``param_groups``.
      op_model: the kernel the run resumes on (None: the one that runs where the state lives).
      tx: optax: the transformation the state belongs to, whose next update is read
        (`jaxguard.optax_probe`) and checked against the values given; None: unchecked.
      uncertifiable: ``"refuse"`` or ``"exact"`` (`jaxguard.uncovered`): what becomes of
        state the guarantee does not cover.
    """

    lr: Any = None
    weight_decay: Any = None
    betas: Any = None
    eps: Any = None
    op_model: str | None = None
    tx: Any = None
    uncertifiable: str = "refuse"

    def given(self) -> bool:
        """Returns: whether any hyperparameter was given (lr, weight_decay, betas or eps)."""
        return any(x is not None for x in (self.lr, self.weight_decay, self.betas, self.eps))


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """What to certify: the next update's hyperparameters and the contract (tau, clip).

    ``lr`` is a number, or an interval ``(lo, hi)`` certified for every rate in it
    (`NextUpdate`); ``source`` says where the hyperparameters came from (`SOURCES`).
    Frozen and hashable; `to_json` / `from_json` round-trip it (a header written before
    `certify` existed parses, with certification on).  ``codec="block8-unguarded"`` means
    block8 with ``certify=False``; ``GuardConfig(codec="block8", certify=False)`` encodes
    to the same entry id, ``block8-unguarded``.

    Raises:
      ConfigError: an unknown codec, bound, partition or op model, a tau or clip that is
        not a finite number > 0 in float32, or invalid hyperparameters
        (`opmodel.validate_hparams`).
    """

    lr: float
    step: int
    tau: float = GuardSpec.tau          # every guard setting's default is GuardSpec's
    clip: float = GuardSpec.clip
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    op_model: str = GuardSpec.op_model
    codec: str = GuardSpec.codec
    bound: str = GuardSpec.bound
    partition: str = GuardSpec.partition
    joint: bool = GuardSpec.joint
    certify: bool = GuardSpec.certify
    source: str = "given"

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if is_interval(self.lr):
            lo, hi = lr_bounds(self.lr)
            object.__setattr__(self, "lr", lo if lo == hi else (lo, hi))
            if lo != hi:
                check_lr_interval(self.lr, self.weight_decay)
        if self.source not in SOURCES:
            raise ConfigError(f"source={self.source!r} is unknown; use one of {', '.join(SOURCES)}")
        if self.codec not in CODECS:
            raise ConfigError(f"codec={self.codec!r} is unknown; use one of {', '.join(CODECS)}")
        if self.bound not in BOUNDS:
            raise ConfigError(f"bound={self.bound!r} is unknown; use 'shared' or 'separate'")
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition={self.partition!r} is unknown; use 'mixed' or 'linear'")
        if self.op_model not in OP_MODELS:
            raise ConfigError(f"op_model={self.op_model!r} is unknown; use one of {', '.join(OP_MODELS)}")
        if not isinstance(self.certify, bool):
            raise ConfigError(f"certify={self.certify!r} must be True or False")
        for name in ("tau", "clip"):
            val = getattr(self, name)
            if (isinstance(val, bool) or not isinstance(val, (int, float)) or not np.isfinite(val) or val <= 0
                    or not 0 < f32(val) < np.inf):
                raise ConfigError(f"{name}={val!r} must be a number > 0 that is finite and nonzero in float32")
        self.constants()  # validates the hyperparameters (both ends of an interval)
        if is_interval(self.lr):
            self.constants("hi")

    @classmethod
    def from_update(cls, spec: GuardSpec, update: NextUpdate) -> "GuardConfig":
        """The config that certifies `update` with the save's settings `spec`.

        Args:
          spec: the save's `GuardSpec` (its op model is ignored: `update` names one).
          update: the next update (`NextUpdate`).

        Returns:
          The `GuardConfig`.

        Raises:
          ConfigError: as the constructor.
        """
        return cls(lr=update.lr, step=update.step, tau=spec.tau, clip=spec.clip, betas=update.betas, eps=update.eps,
                   weight_decay=update.weight_decay, op_model=update.op_model, codec=spec.codec, bound=spec.bound,
                   partition=spec.partition, joint=spec.joint, certify=spec.certify, source=update.source)

    @property
    def update(self) -> NextUpdate:
        """The next update this config certifies (`NextUpdate`)."""
        return NextUpdate(lr=self.lr, step=self.step, betas=self.betas, eps=self.eps,
                          weight_decay=self.weight_decay, op_model=self.op_model, source=self.source)

    @property
    def lr_interval(self) -> tuple:
        """``(lo, hi)`` of the certified learning rates (``lo == hi`` for one)."""
        return lr_bounds(self.lr)

    @classmethod
    def from_spec(cls, spec: GuardSpec, *, lr, step, op_model, betas=(0.9, 0.999), eps=1e-8,
                  weight_decay=0.0) -> "GuardConfig":
        """The config of one parameter group: the save's settings `spec` (its op model is
        ignored: each group's comes from its optimizer) and the next update's hyperparameters.

        Args:
          spec: the save's `GuardSpec` (tau, clip, codec, bound, partition, joint, certify).
          lr, step, betas, eps, weight_decay: the next update's hyperparameters.
          op_model: the group's operation model.

        Returns:
          The `GuardConfig`.

        Raises:
          ConfigError: as the constructor.
        """
        return cls(lr=lr, step=step, tau=spec.tau, clip=spec.clip, betas=betas, eps=eps, weight_decay=weight_decay,
                   op_model=op_model, codec=spec.codec, bound=spec.bound, partition=spec.partition,
                   joint=spec.joint, certify=spec.certify)

    @property
    def spec(self) -> GuardSpec:
        """The static part (`GuardSpec`); ``block8`` with ``certify=False`` is ``block8-unguarded``."""
        codec, certify = self.codec, self.certify and self.codec not in UNGUARDED_ALIASES
        if not certify and codec == "block8":
            codec = "block8-unguarded"
        return GuardSpec(codec=codec, bound=self.bound, partition=self.partition, op_model=self.op_model,
                         tau=float(self.tau), clip=float(self.clip), joint=bool(self.joint), certify=certify)

    def constants(self, at: str = "lo") -> StepConstants:
        """The next update's float32 constants (`opmodel.step_constants`); for an interval,
        those at its ``"lo"`` (default) or ``"hi"`` end (certify through `step_row`, which
        covers the whole interval).

        Args:
          at: ``"lo"`` or ``"hi"``: which end of an interval lr.

        Returns:
          `opmodel.StepConstants` for lr, step, betas, eps, weight decay and the op model.
        Raises:
          ConfigError: invalid hyperparameters.
        """
        lo, hi = self.lr_interval
        return step_constants(self.op_model, lr=hi if at == "hi" else lo if is_interval(self.lr) else self.lr,
                              step=self.step, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def step_row(self) -> "_bound.StepRow":
        """The certificate's constants with tau: a `bound.StepRow` of float32 scalars (for
        an interval lr, `bound.pack_interval`'s row, which certifies every rate in it)."""
        if is_interval(self.lr):
            return _bound.pack_interval(self.constants("lo"), self.constants("hi"), self.tau)
        return _bound.pack_constants(self.constants(), self.tau)

    def to_json(self) -> dict:
        """A JSON-able dict (``certify`` only when False and ``source`` only when not
        ``"given"``, so default headers are unchanged; an interval lr as ``[lo, hi]``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}   # flat fields: no deep copy
        d["betas"] = list(self.betas)
        if is_interval(self.lr):
            d["lr"] = list(self.lr)
        if self.certify:
            del d["certify"]
        if self.source == "given":
            del d["source"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "GuardConfig":
        """The inverse of `to_json`; accepts headers written before ``certify`` existed.

        Args:
          d: the dict `to_json` wrote (a container header's ``config``).

        Returns:
          The `GuardConfig`.

        Raises:
          ConfigError: as the constructor.
        """
        d = {k: v for k, v in d.items() if k in _CONFIG_FIELDS}   # entries also hold the adapter's fields
        if isinstance(d.get("lr"), list):
            d["lr"] = tuple(d["lr"])
        return cls(**{**d, "betas": tuple(d["betas"])})


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(GuardConfig))


def save_spec(spec: GuardSpec | None = None, *, tau=None, clip=None, codec=None, bound=None, partition=None) -> GuardSpec:
    """The guard settings of one save, resolved once at an adapter's entry point.

    Every adapter takes ``spec=`` (a `GuardSpec`) and, for convenience, the keywords below;
    a keyword that is not None overrides the spec's field, and every default is
    `GuardSpec`'s (defined once).  The op model is not a save setting: each parameter
    group's comes from its optimizer (torch) or its weight decay (optax).

    Args:
      spec: a `GuardSpec`, or None for the defaults.
      tau, clip, codec, bound, partition: overrides (None: keep the spec's).

    Returns:
      The `GuardSpec`, checked.

    Raises:
      ConfigError: a spec that is not a `GuardSpec`, or a value the guard does not take
        (one line naming it and the choices).
    """
    if spec is None:
        spec = GuardSpec()
    elif not isinstance(spec, GuardSpec):
        raise ConfigError(f"spec is a {type(spec).__name__}; pass jaxguard.GuardSpec(tau=..., clip=..., codec=...)")
    over = {k: v for k, v in (("tau", tau), ("clip", clip), ("codec", codec), ("bound", bound),
                              ("partition", partition)) if v is not None}
    spec = dataclasses.replace(spec, **over) if over else spec
    # the constructor's checks, on a config with neutral hyperparameters
    GuardConfig.from_spec(spec, lr=1e-3, step=0, op_model=GuardSpec.op_model)
    return spec
