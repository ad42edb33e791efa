"""Which FP32 operation variant the installed torch uses for single-tensor Adam on CPU.

Three things vary between machines and builds (see docs/replay.md):

* whether ATen fuses ``lerp_``, ``addcmul_`` and ``add(alpha=)`` into an FMA (it does on
  the AVX2/AVX-512 ATen paths, not with ``ATEN_CPU_CAPABILITY=default``);
* ``torch.sqrt``: MKL's ``vsSqrt`` is not correctly rounded, and its kernel depends on the
  CPU. We model it as "IEEE sqrt, then -1/0/+1 ulp from a correction table indexed by
  (exponent parity, mantissa)", measured from ``torch.sqrt`` itself on the 2^24 inputs
  of [1, 4). The table is two 2 MiB bitsets, built at first use in about 0.2 s and cached
  under ``$XDG_CACHE_HOME/jaxguard`` (default ``~/.cache/jaxguard``), keyed by torch,
  MKL, ATen capability, CPU model and flags, and the MKL environment variables;
* nothing else was observed to vary (division by the bias-correction scalar is a true
  division, scalars are Python doubles rounded once to float32).

This module holds what the replay needs to run a given variant: the variant types
(`AdamVariant`, `FusedAdamVariant`), the measured sqrt table and its on-disk cache, and
the environment fingerprint. Finding the variant of the installed torch is
`torch_compat.calibrate`; the imports point one way:
float32 <- variant <- calibrate <- replay <- variant_cache (`torch_compat.replay.detect_variant`
etc. hand calibrate the replay it checks candidates with).
"""

from __future__ import annotations

__all__ = ["SQRT_TABLE_SIZE", "ReplayVariantWarning", "AdamVariant", "SqrtTable", "require_torch",
           "environment_fingerprint", "cpu_description", "cache_dir", "float32_from_bits", "torch_sqrt", "binade_name",
           "EDGE_BINADES", "measure_sqrt_table", "torch_sqrt_table", "ieee_sqrt_table", "sqrt_table_for",
           "calibration_rng", "IMPLEMENTATIONS", "VECTOR_WIDTHS", "FusedAdamVariant", "check_implementation",
           "ReplayFunctions"]

import dataclasses
import functools
import hashlib
import json
import os
import platform
import re
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from jaxguard.errors import ConfigError, ContainerError, install_hint
from jaxguard.format import storage
from torch_compat.float32 import MANTISSA_BITS

SQRT_TABLE_SIZE = 1 << (MANTISSA_BITS + 1)  # exponent parity x 2^23 mantissas
SQRT_TABLE_WORDS = SQRT_TABLE_SIZE // 32
BINADE_WORDS = (1 << MANTISSA_BITS) // 32
SQRT_TABLE_FORMAT = 2  # 2: per-binade tables for binades that do not follow the shared one
SQRT_KINDS = ("ieee", "mkl-table")


class ReplayVariantWarning(RuntimeWarning):
    """The installed torch matched none of the modelled operation variants."""


@dataclasses.dataclass(frozen=True)
class AdamVariant:
    """One FP32 operation variant of torch's single-tensor Adam; JSON-able via ``to_dict``.

    ``sqrt`` is ``"ieee"`` (correctly rounded) or ``"mkl-table"`` (IEEE plus the measured
    per-(parity, mantissa) correction; ``sqrt_ulps_below``/``sqrt_ulps_above`` count the
    table's -1/+1 entries out of 2^24 and ``sqrt_table_sha256`` names it).
    ``v_decay_fma`` selects the second-moment form ``fma(v, b2, (c2*g)*g)`` (the scalar
    tail of torch's fused CPU kernel as compiled) over ``addcmul_fma``'s
    ``fma(c2*g, g, v*b2)``; the single-tensor kernels never use it.
    """

    lerp_fma: bool = True
    addcmul_fma: bool = True
    add_alpha_fma: bool = True
    sqrt: str = "mkl-table"
    v_decay_fma: bool = False  # v' = fma(v, f32(b2), (f32(1-b2)*g)*g): the fused kernel's scalar tail
    matched: bool = True
    torch: str = ""
    aten_cpu_capability: str = ""
    mkl: str = ""
    cpu: str = ""
    sqrt_ulps_below: int = 0
    sqrt_ulps_above: int = 0
    sqrt_table_sha256: str = ""
    detail: str = ""

    def __post_init__(self):
        if self.sqrt not in SQRT_KINDS:
            raise ConfigError(f"AdamVariant.sqrt={self.sqrt!r} is unknown; use one of {SQRT_KINDS}")

    def to_dict(self) -> dict:
        """The variant as a JSON-ready dict (field name -> value; the inverse is
        ``AdamVariant(**d)``).
        """
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, eq=False)
class _BinadeTable:
    """Where torch.sqrt is one ulp below/above IEEE on the binade of biased ``exponent``
    (0: the subnormals), as bitsets over its 2^23 mantissas."""

    exponent: int
    below: np.ndarray  # uint32[BINADE_WORDS]
    above: np.ndarray  # uint32[BINADE_WORDS]


@dataclasses.dataclass(frozen=True, eq=False)
class SqrtTable:
    """Bitsets over index ``(1 - exponent_parity) << 23 | mantissa``: where torch.sqrt is
    one ulp below (``below``) or above (``above``) the IEEE square root on normal inputs;
    ``binades`` overrides that for binades where torch does not scale (measured in full)."""

    below: np.ndarray  # uint32[SQRT_TABLE_WORDS]
    above: np.ndarray  # uint32[SQRT_TABLE_WORDS]
    sha256: str
    binades: tuple = ()

    @property
    def ulps_below(self) -> int:
        """How many shared-table inputs torch.sqrt rounds one ulp below IEEE."""
        return int(np.unpackbits(self.below.view(np.uint8)).sum())

    @property
    def ulps_above(self) -> int:
        """How many shared-table inputs torch.sqrt rounds one ulp above IEEE."""
        return int(np.unpackbits(self.above.view(np.uint8)).sum())

    @property
    def own_binades(self) -> tuple:
        """Biased exponents with a table of their own (0 stands for the subnormals)."""
        return tuple(b.exponent for b in self.binades)

    @property
    def is_ieee(self) -> bool:
        """True when no table (shared or per binade) has a correction: torch.sqrt is IEEE."""
        return not (self.below.any() or self.above.any() or any(b.below.any() or b.above.any() for b in self.binades))


def _table_digest(below, above, binades) -> str:
    h = hashlib.sha256(below.tobytes() + above.tobytes())
    for b in binades:
        h.update(np.int32(b.exponent).tobytes() + b.below.tobytes() + b.above.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Environment fingerprint


def require_torch():
    """The torch module, or a one-line `ConfigError` saying how to install it."""
    try:
        import torch
    except ImportError:
        raise ConfigError(f"torch is not importable; install it with {install_hint('torch')} "
                          "or pass variant= explicitly") from None
    return torch


def cpu_description() -> str:
    """The CPU a measured variant was measured on, without importing torch: vendor, model
    name and a hash of the feature flags (``/proc/cpuinfo``), else what `platform` says.

    Returns:
      One line, e.g. ``"GenuineIntel | Intel(R) Xeon(R) ... | flags-sha256:0123abcd..."``.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
        flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
        vendor = re.search(r"^vendor_id\s*:\s*(.*)$", text, re.M)
        parts = [m.group(1).strip() for m in (vendor, model) if m]
        if flags:
            parts.append("flags-sha256:" + hashlib.sha256(flags.group(1).encode()).hexdigest()[:16])
        return " | ".join(parts) or platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def _mkl_version() -> str:
    torch = require_torch()
    found = re.search(r"Math Kernel Library Version (\S+)", torch.__config__.show())
    return found.group(1) if found else "none"


@functools.lru_cache(maxsize=1)
def environment_fingerprint() -> dict:
    """What a measured variant depends on: torch version, ATen CPU capability, MKL
    version, CPU model and the kernel-selecting environment variables (cached per process;
    ``environment_fingerprint.cache_clear()`` re-reads them).

    Returns:
      ``{"torch", "aten_cpu_capability", "mkl", "cpu", "env": {ATEN_CPU_CAPABILITY,
      MKL_ENABLE_INSTRUCTIONS, MKL_CBWR}}`` (strings).

    Raises:
      ConfigError: torch is not installed.
    """
    torch = require_torch()
    return {
        "torch": torch.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": _mkl_version(),
        "cpu": cpu_description(),
        "env": {k: os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")},
    }


def cache_dir() -> Path:
    """Where measured variants and sqrt tables are cached: ``$XDG_CACHE_HOME/jaxguard``
    (default ``~/.cache/jaxguard``); it may not exist yet.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxguard"


# ---------------------------------------------------------------------------------------
# The sqrt correction table


def float32_from_bits(bits: np.ndarray) -> np.ndarray:
    """Reinterpret uint32 bit patterns as float32 (no rounding).

    Args:
      bits: integer bit patterns (converted to uint32).

    Returns:
      float32 values of bits' shape.
    """
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _one_binade_pair_inputs() -> np.ndarray:
    """All float32 in [1, 4), ordered by table index (biased exponents 127 then 128)."""
    mantissas = np.arange(1 << MANTISSA_BITS, dtype=np.uint32)
    return np.concatenate([float32_from_bits((np.uint32(e) << MANTISSA_BITS) | mantissas) for e in (127, 128)])


def _binade_inputs(exponent: int, mantissas: np.ndarray | None = None) -> np.ndarray:
    if mantissas is None:
        mantissas = np.arange(1 << MANTISSA_BITS, dtype=np.uint32)
    return float32_from_bits((np.uint32(exponent) << MANTISSA_BITS) | mantissas.astype(np.uint32))


def torch_sqrt(x: np.ndarray) -> np.ndarray:
    """The installed torch's float32 sqrt on CPU (the op being measured).

    Args:
      x: float32 values.

    Returns:
      float32 ``torch.sqrt(x)`` as a numpy array of x's shape.

    Raises:
      ConfigError: torch is not installed.
    """
    torch = require_torch()
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).sqrt().numpy()


def _pack(mask: np.ndarray) -> np.ndarray:
    return np.packbits(mask, bitorder="little").view(np.uint32).copy()


def _ulp_offsets(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return torch_sqrt(x).view(np.int32).astype(np.int64) - np.sqrt(x).view(np.int32)


def _one_ulp_or_fail(offset: np.ndarray, where: str) -> None:
    worst = int(np.abs(offset).max()) if offset.size else 0
    if worst > 1:
        raise ConfigError(
            f"torch.sqrt is {worst} ulps from IEEE on {where}; the replay's sqrt model covers 1 ulp only: "
            "pass variant= with sqrt='ieee' to opt out"
        )


def binade_name(exponent: int) -> str:
    """How messages name a binade.

    Args:
      exponent: the biased float32 exponent (0 for the subnormals).

    Returns:
      e.g. ``"the binade [2^-3, 2^-2)"`` or ``"the subnormals"``.
    """
    return "the subnormals" if exponent == 0 else f"the binade [2^{exponent - 127}, 2^{exponent - 126})"


def _binade_offsets(exponent: int, mantissas: np.ndarray) -> np.ndarray:
    offset = _ulp_offsets(_binade_inputs(exponent, mantissas))
    if exponent == 0:
        offset[mantissas == 0] = 0  # +0.0 is not a subnormal
    return offset


def _binade_table(exponent: int, offset: np.ndarray) -> _BinadeTable:
    _one_ulp_or_fail(offset, binade_name(exponent))
    return _BinadeTable(exponent=exponent, below=_pack(offset == -1), above=_pack(offset == 1))


# Binades measured in full on every machine: the subnormals (MKL's slow path: IEEE on the
# AMD EPYC measured, 2^24-scaled on the Intel Xeon) and the ends of the normal range
# (the top binade differed on 2,048 mantissas next to FLT_MAX on AMD EPYC).
EDGE_BINADES = (0, 1, 2, 253, 254)
SCAN_SAMPLES = 2048  # mantissas per other binade, plus a sample of the table's +-1 entries


def measure_sqrt_table() -> SqrtTable:
    """Call torch.sqrt on every (parity, mantissa) pattern and record its ulp offsets from
    IEEE; measure the edge binades in full, scan every other binade on a sample, and give
    a binade its own table wherever torch does not follow the shared one."""
    offset = _ulp_offsets(_one_binade_pair_inputs())
    _one_ulp_or_fail(offset, "[1, 4)")
    below, above = _pack(offset == -1), _pack(offset == 1)
    half = 1 << MANTISSA_BITS
    every = np.arange(half, dtype=np.uint32)

    def shared_offsets(exponent, mantissas):  # what the shared table predicts for this binade
        if exponent == 0:
            return np.zeros(mantissas.size, np.int64)
        return offset[(1 - (exponent & 1)) * half + mantissas.astype(np.int64)]

    rng = calibration_rng()
    special = np.flatnonzero(offset != 0).astype(np.uint32) & 0x7FFFFF
    sample = np.unique(np.concatenate([
        rng.integers(0, half, SCAN_SAMPLES, dtype=np.uint32),
        rng.choice(special, size=min(512, special.size), replace=False) if special.size else every[:0],
        np.array([0, 1, half - 2, half - 1], np.uint32)]))
    scanned = [e for e in range(255) if e not in EDGE_BINADES]
    sampled = _ulp_offsets(np.concatenate([_binade_inputs(e, sample) for e in scanned])).reshape(len(scanned), -1)
    own = []
    for exponent in range(255):
        if exponent in EDGE_BINADES:
            measured = _binade_offsets(exponent, every)
        else:
            if np.array_equal(sampled[scanned.index(exponent)], shared_offsets(exponent, sample)):
                continue
            measured = _binade_offsets(exponent, every)
        if not np.array_equal(measured, shared_offsets(exponent, every)):
            own.append(_binade_table(exponent, measured))
    binades = tuple(own)
    return SqrtTable(below=below, above=above, sha256=_table_digest(below, above, binades), binades=binades)


def _table_path() -> Path:
    key = hashlib.sha256(json.dumps(environment_fingerprint(), sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"torch-sqrt-table-v{SQRT_TABLE_FORMAT}-{key}.npz"


def _load_cached_table(path: Path) -> SqrtTable | None:
    try:
        with np.load(path) as data:
            below, above = data["below"], data["above"]
            stored = str(data["sha256"])
            exponents = data["binade_exponents"].astype(int)
            binade_below, binade_above = data["binade_below"], data["binade_above"]
    except (OSError, KeyError, ValueError):
        return None
    if below.shape != (SQRT_TABLE_WORDS,) or above.shape != (SQRT_TABLE_WORDS,):
        return None
    if binade_below.shape != (exponents.size, BINADE_WORDS) or binade_above.shape != binade_below.shape:
        return None
    binades = tuple(_BinadeTable(int(e), b.astype(np.uint32), a.astype(np.uint32))
                    for e, b, a in zip(exponents, binade_below, binade_above))
    if _table_digest(below, above, binades) != stored:
        return None
    return SqrtTable(below=below.astype(np.uint32), above=above.astype(np.uint32), sha256=stored, binades=binades)


def _store_table(path: Path, table: SqrtTable) -> None:
    def write(fh):
        np.savez_compressed(
            fh, below=table.below, above=table.above, sha256=np.array(table.sha256),
            binade_exponents=np.array(table.own_binades, np.int32),
            binade_below=np.array([b.below for b in table.binades], np.uint32).reshape(-1, BINADE_WORDS),
            binade_above=np.array([b.above for b in table.binades], np.uint32).reshape(-1, BINADE_WORDS))

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.atomic_write_with(path, write)
    except (OSError, ContainerError):
        pass  # a read-only cache only costs the 0.2 s rebuild next time


@functools.lru_cache(maxsize=1)
def torch_sqrt_table() -> SqrtTable:
    """The measured table for this process's torch/MKL/CPU: from the cache or measured now."""
    path = _table_path()
    table = _load_cached_table(path)
    if table is None:
        table = measure_sqrt_table()
        _store_table(path, table)
    return table


@functools.lru_cache(maxsize=1)
def ieee_sqrt_table() -> SqrtTable:
    """The table of an IEEE (correctly rounded) sqrt: no corrections anywhere."""
    zeros = np.zeros(SQRT_TABLE_WORDS, np.uint32)
    return SqrtTable(below=zeros, above=zeros, sha256=_table_digest(zeros, zeros, ()))


def sqrt_table_for(variant: AdamVariant) -> SqrtTable:
    """The sqrt table a variant's replay uses.

    Args:
      variant: an `AdamVariant`; ``sqrt == "ieee"`` needs no measurement.

    Returns:
      `ieee_sqrt_table()`, or this machine's measured `torch_sqrt_table()`.

    Raises:
      ConfigError: the variant records another machine's table (its sha256 differs),
        or torch is not installed for a measured table.
    """
    if variant.sqrt == "ieee":
        return ieee_sqrt_table()
    table = torch_sqrt_table()
    if variant.sqrt_table_sha256 and variant.sqrt_table_sha256 != table.sha256:
        raise ConfigError(
            f"variant sqrt table {variant.sqrt_table_sha256[:12]} differs from this machine's "
            f"{table.sha256[:12]}; call detect_variant() here instead of reusing another machine's variant"
        )
    return table

def calibration_rng() -> np.random.Generator:
    """The fixed-seed generator of the calibration inputs (same inputs on every machine)."""
    return np.random.default_rng(20240605)


# The other torch implementations: foreach=True and fused=True (CPU)

IMPLEMENTATIONS = ("single", "foreach", "fused")
VECTOR_WIDTHS = (8, 16, 4, 32, 64)  # candidate float lanes of ATen's Vectorized<float>


@dataclasses.dataclass(frozen=True)
class FusedAdamVariant:
    """torch's fused CPU Adam kernel (``torch._fused_adam_``/``_fused_adamw_``): a vector
    body and a scalar tail (the last ``numel % vector_width`` elements of each tensor),
    each one op variant of its own; JSON-able via ``to_dict``."""

    body: AdamVariant
    tail: AdamVariant
    vector_width: int
    matched: bool = True
    detail: str = ""

    def to_dict(self) -> dict:
        """The variant as a JSON-ready dict (``implementation="fused"``, body and tail
        nested; the inverse is `from_dict`).
        """
        return {"implementation": "fused", "vector_width": self.vector_width, "matched": self.matched,
                "detail": self.detail, "body": self.body.to_dict(), "tail": self.tail.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "FusedAdamVariant":
        """The inverse of `to_dict`.

        Args:
          d: a dict written by `to_dict` (``matched`` and ``detail`` optional).

        Returns:
          The `FusedAdamVariant`.
        """
        return cls(body=AdamVariant(**d["body"]), tail=AdamVariant(**d["tail"]), vector_width=int(d["vector_width"]),
                   matched=bool(d.get("matched", True)), detail=str(d.get("detail", "")))


def check_implementation(implementation: str) -> str:
    """Args: implementation: "single", "foreach" or "fused". Returns: it, checked.

    Raises:
      ConfigError: any other value.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"implementation={implementation!r} is unknown; use one of {', '.join(IMPLEMENTATIONS)} "
                          "(torch.optim.Adam's foreach=False/fused=False, foreach=True, fused=True on CPU)")
    return implementation



class ReplayFunctions(NamedTuple):
    """The replay functions the calibration checks candidates with (`torch_compat.replay`
    hands them over, so that calibrate never imports replay)."""

    adam_step: Callable
    numpy_adam_step: Callable
    torch_adam_step_many: Callable
