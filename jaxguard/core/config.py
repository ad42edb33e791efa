"""What to certify: a static `GuardSpec` (compile-time) and the per-step constants.

`GuardConfig` is the public constructor (and what container headers store, via
`to_json`/`from_json`).  It splits into ``cfg.spec``, a hashable `GuardSpec` (codec,
bound, partition, op model, tau, clip, joint, certify: a jit static argument), and
``cfg.constants()``, the `opmodel.StepConstants` of the next update (lr, step, betas,
eps, weight decay); ``cfg.step_row()`` packs those with tau as the certificate's
float32 `bound.StepRow`, which a jitted save hook takes as a traced argument so that a
new step or learning rate does not recompile.
"""
from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """What to certify: the next update's hyperparameters and the contract (tau, clip).

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

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
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
        self.constants()  # validates the hyperparameters

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

    def constants(self) -> StepConstants:
        """The next update's float32 constants (`opmodel.step_constants`).

        Returns:
          `opmodel.StepConstants` for lr, step, betas, eps, weight decay and the op model.
        Raises:
          ConfigError: invalid hyperparameters.
        """
        return step_constants(self.op_model, lr=self.lr, step=self.step, betas=self.betas,
                              eps=self.eps, weight_decay=self.weight_decay)

    def step_row(self) -> "_bound.StepRow":
        """The certificate's constants with tau: a `bound.StepRow` of float32 scalars."""
        return _bound.pack_constants(self.constants(), self.tau)

    def to_json(self) -> dict:
        """A JSON-able dict (``certify`` only when False, so default headers are unchanged)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}   # flat fields: no deep copy
        d["betas"] = list(self.betas)
        if self.certify:
            del d["certify"]
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
        return cls(**{**d, "betas": tuple(d["betas"])})


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
