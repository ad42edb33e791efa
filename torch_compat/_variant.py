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

``detect_variant`` calibrates each op on crafted inputs that discriminate the
candidates, then confirms the chosen model end to end on a calibration Adam step
(body and scalar tail). The result is cached per process.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import platform
import re
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from jaxguard.errors import ConfigError
from torch_compat.float32 import MANTISSA_BITS, fma_float32_numpy, sqrt_float32_numpy

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
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, eq=False)
class BinadeTable:
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
        return int(np.unpackbits(self.below.view(np.uint8)).sum())

    @property
    def ulps_above(self) -> int:
        return int(np.unpackbits(self.above.view(np.uint8)).sum())

    @property
    def own_binades(self) -> tuple:
        """Biased exponents with a table of their own (0 stands for the subnormals)."""
        return tuple(b.exponent for b in self.binades)

    @property
    def is_ieee(self) -> bool:
        return not (self.below.any() or self.above.any() or any(b.below.any() or b.above.any() for b in self.binades))


def _table_digest(below, above, binades) -> str:
    h = hashlib.sha256(below.tobytes() + above.tobytes())
    for b in binades:
        h.update(np.int32(b.exponent).tobytes() + b.below.tobytes() + b.above.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Environment fingerprint


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise ConfigError("torch is not importable; install torch==2.13.0 or pass variant= explicitly") from exc
    return torch


def _cpu_description() -> str:
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
    torch = _torch()
    found = re.search(r"Math Kernel Library Version (\S+)", torch.__config__.show())
    return found.group(1) if found else "none"


@functools.lru_cache(maxsize=1)
def environment_fingerprint() -> dict:
    torch = _torch()
    return {
        "torch": torch.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": _mkl_version(),
        "cpu": _cpu_description(),
        "env": {k: os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")},
    }


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxguard"


# ---------------------------------------------------------------------------------------
# The sqrt correction table


def float32_from_bits(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _one_binade_pair_inputs() -> np.ndarray:
    """All float32 in [1, 4), ordered by table index (biased exponents 127 then 128)."""
    mantissas = np.arange(1 << MANTISSA_BITS, dtype=np.uint32)
    return np.concatenate([float32_from_bits((np.uint32(e) << MANTISSA_BITS) | mantissas) for e in (127, 128)])


def _binade_inputs(exponent: int, mantissas: np.ndarray | None = None) -> np.ndarray:
    if mantissas is None:
        mantissas = np.arange(1 << MANTISSA_BITS, dtype=np.uint32)
    return float32_from_bits((np.uint32(exponent) << MANTISSA_BITS) | mantissas.astype(np.uint32))


def _torch_sqrt(x: np.ndarray) -> np.ndarray:
    torch = _torch()
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).sqrt().numpy()


def _pack(mask: np.ndarray) -> np.ndarray:
    return np.packbits(mask, bitorder="little").view(np.uint32).copy()


def _ulp_offsets(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return _torch_sqrt(x).view(np.int32).astype(np.int64) - np.sqrt(x).view(np.int32)


def _one_ulp_or_fail(offset: np.ndarray, where: str) -> None:
    worst = int(np.abs(offset).max()) if offset.size else 0
    if worst > 1:
        raise ConfigError(
            f"torch.sqrt is {worst} ulps from IEEE on {where}; the replay's sqrt model covers 1 ulp only: "
            "pass variant= with sqrt='ieee' to opt out"
        )


def _binade_name(exponent: int) -> str:
    return "the subnormals" if exponent == 0 else f"the binade [2^{exponent - 127}, 2^{exponent - 126})"


def _binade_offsets(exponent: int, mantissas: np.ndarray) -> np.ndarray:
    offset = _ulp_offsets(_binade_inputs(exponent, mantissas))
    if exponent == 0:
        offset[mantissas == 0] = 0  # +0.0 is not a subnormal
    return offset


def _binade_table(exponent: int, offset: np.ndarray) -> BinadeTable:
    _one_ulp_or_fail(offset, _binade_name(exponent))
    return BinadeTable(exponent=exponent, below=_pack(offset == -1), above=_pack(offset == 1))


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

    rng = _calibration_rng()
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
    binades = tuple(BinadeTable(int(e), b.astype(np.uint32), a.astype(np.uint32))
                    for e, b, a in zip(exponents, binade_below, binade_above))
    if _table_digest(below, above, binades) != stored:
        return None
    return SqrtTable(below=below.astype(np.uint32), above=above.astype(np.uint32), sha256=stored, binades=binades)


def _store_table(path: Path, table: SqrtTable) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
            np.savez_compressed(
                tmp, below=table.below, above=table.above, sha256=np.array(table.sha256),
                binade_exponents=np.array(table.own_binades, np.int32),
                binade_below=np.array([b.below for b in table.binades], np.uint32).reshape(-1, BINADE_WORDS),
                binade_above=np.array([b.above for b in table.binades], np.uint32).reshape(-1, BINADE_WORDS))
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, path)
    except OSError:
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
    zeros = np.zeros(SQRT_TABLE_WORDS, np.uint32)
    return SqrtTable(below=zeros, above=zeros, sha256=_table_digest(zeros, zeros, ()))


def sqrt_table_for(variant: AdamVariant) -> SqrtTable:
    if variant.sqrt == "ieee":
        return ieee_sqrt_table()
    table = torch_sqrt_table()
    if variant.sqrt_table_sha256 and variant.sqrt_table_sha256 != table.sha256:
        raise ConfigError(
            f"variant sqrt table {variant.sqrt_table_sha256[:12]} differs from this machine's "
            f"{table.sha256[:12]}; call detect_variant() here instead of reusing another machine's variant"
        )
    return table


# ---------------------------------------------------------------------------------------
# Calibration


def _exact_fma32(a, b, c) -> np.ndarray:
    return fma_float32_numpy(a, b, c)


def _calibration_rng() -> np.random.Generator:
    return np.random.default_rng(20240605)


def _first_match(observed: np.ndarray, fused: np.ndarray, unfused: np.ndarray) -> bool | None:
    same = lambda x: np.array_equal(observed.view(np.int32), x.view(np.int32))  # noqa: E731
    fused_ok, unfused_ok = same(fused), same(unfused)
    if fused_ok == unfused_ok:
        return None  # neither matched (or the inputs failed to discriminate)
    return fused_ok


def _calibrate_fma_ops(n: int = 20_011) -> dict:
    """Run lerp_, addcmul_ and add(alpha=) on inputs where the fused and unfused results
    differ on thousands of coordinates; report which one torch produced."""
    torch = _torch()
    rng = _calibration_rng()
    g = (rng.standard_normal(n) * 0.05).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = np.abs(rng.standard_normal(n) * 1e-6).astype(np.float32)
    p = rng.standard_normal(n).astype(np.float32)
    weight, value, alpha, beta2 = 1 - 0.9, 1 - 0.999, 0.1, 0.999
    f32 = np.float32

    lerp = torch.from_numpy(m.copy()).lerp_(torch.from_numpy(g), weight).numpy()
    lerp_fused = _exact_fma32(f32(weight), g - m, m)
    lerp_unfused = m + f32(weight) * (g - m)

    v1 = v * f32(beta2)
    addcmul = torch.from_numpy(v.copy()).mul_(beta2).addcmul_(torch.from_numpy(g), torch.from_numpy(g), value=value).numpy()
    addcmul_fused = _exact_fma32(f32(value) * g, g, v1)
    addcmul_unfused = v1 + (f32(value) * g) * g

    add = torch.from_numpy(g).add(torch.from_numpy(p), alpha=alpha).numpy()
    add_fused = _exact_fma32(f32(alpha), p, g)
    add_unfused = g + f32(alpha) * p
    return {
        "lerp_fma": _first_match(lerp, lerp_fused, lerp_unfused),
        "addcmul_fma": _first_match(addcmul, addcmul_fused, addcmul_unfused),
        "add_alpha_fma": _first_match(add, add_fused, add_unfused),
    }


def _calibrate_sqrt(table: SqrtTable) -> tuple[str | None, str]:
    """Check the model against torch.sqrt on fresh samples of every binade (subnormals
    included), weighted to the inputs where the table deviates from IEEE. Returns the
    sqrt kind, or None and the input classes it does not reproduce."""
    rng = np.random.default_rng(20240606)  # not the measurement's samples
    index = np.arange(SQRT_TABLE_SIZE, dtype=np.uint32)
    bits_set = np.unpackbits((table.below | table.above).view(np.uint8), bitorder="little").astype(bool)
    special = index[bits_set] & 0x7FFFFF
    mantissas = rng.integers(0, 1 << MANTISSA_BITS, 512, dtype=np.uint32)
    if special.size:
        mantissas = np.concatenate([mantissas, rng.choice(special, size=min(256, special.size), replace=False)])
    unmatched = []
    for exponent in range(0, 255):
        picked = mantissas
        if exponent in table.own_binades or exponent in EDGE_BINADES:
            picked = np.concatenate([mantissas, rng.integers(0, 1 << MANTISSA_BITS, 8192, dtype=np.uint32),
                                     np.arange((1 << MANTISSA_BITS) - 2048, 1 << MANTISSA_BITS, dtype=np.uint32)])
        x = float32_from_bits((np.uint32(exponent) << MANTISSA_BITS) | picked)
        x = x[x != 0]
        if not np.array_equal(_torch_sqrt(x).view(np.int32), sqrt_float32_numpy(x, table).view(np.int32)):
            unmatched.append(_binade_name(exponent))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, -1e-45], np.float32)
    got, want = _torch_sqrt(specials), sqrt_float32_numpy(specials, table)
    if not np.array_equal(np.isnan(got), np.isnan(want)) or not np.array_equal(
            got[~np.isnan(got)].view(np.int32), want[~np.isnan(want)].view(np.int32)):
        unmatched.append("zero/inf/nan/negative inputs")
    if unmatched:
        return None, "sqrt: the measured table does not reproduce torch.sqrt on " + ", ".join(unmatched[:6]) + (
            f" (+{len(unmatched) - 6} more)" if len(unmatched) > 6 else "")
    return ("ieee" if table.is_ieee else "mkl-table"), ""


def _calibration_problem(n_body: int = 4096 * 3, n_short: tuple = (1, 3, 7, 15, 17, 31, 33, 100, 255)):
    rng = _calibration_rng()
    lengths = (n_body, *n_short)
    tensors = []
    for n in lengths:
        g = (rng.standard_normal(n) * 0.02).astype(np.float32)
        g[rng.random(n) < 0.05] = 0.0
        m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        v = (10.0 ** rng.uniform(-14, -2, n)).astype(np.float32)
        p = (rng.standard_normal(n) * 0.05).astype(np.float32)
        tensors.append((p, g, m, v))
    return tensors


def _confirm_end_to_end(variant: AdamVariant, implementation: str = "single") -> str:
    """Compare the replay with torch on calibration Adam/AdamW steps; '' when all equal."""
    from torch_compat.replay import adam_step, torch_adam_step_many

    problems = []
    for kwargs in (
        dict(step=9, lr=1e-3, weight_decay=0.0, decoupled=False),
        dict(step=0, lr=6e-4, weight_decay=0.01, decoupled=False),
        dict(step=999, lr=1e-3, weight_decay=0.1, decoupled=True),
    ):
        tensors = _calibration_problem()
        # torch steps each tensor separately (own scalar tail); the replay is elementwise
        want = [np.concatenate(x) for x in torch_adam_step_many(*zip(*tensors), implementation=implementation,
                                                                **kwargs)]
        got = adam_step(*(np.concatenate(x) for x in zip(*tensors)), variant=variant, **kwargs)
        for name, a, b in zip("pmv", want, got):
            bad = int(np.count_nonzero(a.view(np.int32) != b.view(np.int32)))
            if bad:
                problems.append(f"{name}: {bad}/{a.size} differ ({kwargs})")
    return "; ".join(problems[:3])


_DETECTED: AdamVariant | None = None


def detect_variant(refresh: bool = False) -> AdamVariant:
    """Calibrate the installed torch once per process and return the matching variant.

    On no match: a ``ReplayVariantWarning``, ``matched=False``, and the documented default
    model (every op fused, measured sqrt table when it is within 1 ulp, else IEEE).
    """
    global _DETECTED
    if _DETECTED is not None and not refresh:
        return _DETECTED
    started = time.perf_counter()
    fingerprint = environment_fingerprint()
    about = dict(
        torch=fingerprint["torch"],
        aten_cpu_capability=fingerprint["aten_cpu_capability"],
        mkl=fingerprint["mkl"],
        cpu=fingerprint["cpu"],
    )
    problems = []
    try:
        table = torch_sqrt_table()
    except ConfigError as exc:
        table, problems = ieee_sqrt_table(), [str(exc)]
    fma = _calibrate_fma_ops()
    for op, fused in fma.items():
        if fused is None:
            problems.append(f"{op}: torch matched neither the fused nor the unfused model")
    sqrt_kind, sqrt_problem = _calibrate_sqrt(table)
    if sqrt_kind is None:
        problems.append(sqrt_problem)
    variant = AdamVariant(
        lerp_fma=fma["lerp_fma"] is not False,
        addcmul_fma=fma["addcmul_fma"] is not False,
        add_alpha_fma=fma["add_alpha_fma"] is not False,
        sqrt=sqrt_kind or ("ieee" if table.is_ieee else "mkl-table"),
        matched=True,
        sqrt_ulps_below=table.ulps_below,
        sqrt_ulps_above=table.ulps_above,
        sqrt_table_sha256=table.sha256,
        **about,
    )
    end_to_end = _confirm_end_to_end(variant)
    if end_to_end:
        problems.append("end-to-end: " + end_to_end)
    seconds = time.perf_counter() - started
    if problems:
        detail = "; ".join(problems)
        warnings.warn(
            f"torch_compat replay matched no modelled torch variant ({detail}); "
            "using the documented default model, which may not be bit-exact here",
            ReplayVariantWarning,
            stacklevel=2,
        )
        variant = dataclasses.replace(variant, matched=False, detail=detail)
    else:
        variant = dataclasses.replace(variant, detail=f"calibrated in {seconds:.2f} s")
    _DETECTED = variant
    return variant


def variant_record() -> dict:
    """The detected variant as a JSON-able dict for a container header or a CLI report,
    without a Python warning: a mismatch is reported in ``matched``/``detail``.  Cached on
    disk per environment (`torch_compat.variant_cache`)."""
    from torch_compat.variant_cache import cached_detect_variant  # imports this module

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplayVariantWarning)
            return cached_detect_variant()[0].to_dict()   # once per environment, not per run
    except Exception as exc:  # noqa: BLE001 - the variant is informational: the guard does not use it
        return {"matched": False, "detail": f"variant detection failed: {exc}"[:300]}


# ---------------------------------------------------------------------------------------
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
        return {"implementation": "fused", "vector_width": self.vector_width, "matched": self.matched,
                "detail": self.detail, "body": self.body.to_dict(), "tail": self.tail.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "FusedAdamVariant":
        return cls(body=AdamVariant(**d["body"]), tail=AdamVariant(**d["tail"]), vector_width=int(d["vector_width"]),
                   matched=bool(d.get("matched", True)), detail=str(d.get("detail", "")))


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"implementation={implementation!r} is unknown; use one of {', '.join(IMPLEMENTATIONS)} "
                          "(torch.optim.Adam's foreach=False/fused=False, foreach=True, fused=True on CPU)")
    return implementation


def _op_candidates(base: AdamVariant):
    """Every op variant the fused kernel could be compiled to (FMA contraction of each
    op, three second-moment forms, IEEE or the measured sqrt)."""
    sqrt_kinds = ["ieee"] + (["mkl-table"] if base.sqrt == "mkl-table" else [])
    for sqrt, lerp, add_alpha, v_form in itertools.product(
            sqrt_kinds, (True, False), (True, False), ("addcmul-fma", "unfused", "decay-fma")):
        yield dataclasses.replace(
            base, sqrt=sqrt, lerp_fma=lerp, add_alpha_fma=add_alpha, addcmul_fma=v_form == "addcmul-fma",
            v_decay_fma=v_form == "decay-fma", sqrt_table_sha256=base.sqrt_table_sha256 if sqrt != "ieee" else "",
            sqrt_ulps_below=base.sqrt_ulps_below if sqrt != "ieee" else 0,
            sqrt_ulps_above=base.sqrt_ulps_above if sqrt != "ieee" else 0, matched=True, detail="")


FUSED_CALIBRATION = (
    dict(step=9, lr=1e-3, weight_decay=0.01, decoupled=False),  # coupled decay: discriminates add(alpha) fusing
    dict(step=999, lr=1e-3, weight_decay=0.1, decoupled=True),
)


def _fused_calibration_runs():
    """Real fused torch steps on one long tensor (all vector body for every candidate
    width) and short tensors of every length 1..127 (scalar tails)."""
    from torch_compat.replay import torch_adam_step_many

    lengths = (64 * 192,) + tuple(range(1, 128)) * 2
    rng = _calibration_rng()
    runs = []
    for kwargs in FUSED_CALIBRATION:
        tensors = []
        for n in lengths:
            tensors.append(((rng.standard_normal(n) * 0.05).astype(np.float32),
                            (rng.standard_normal(n) * 0.02).astype(np.float32),
                            (rng.standard_normal(n) * 1e-3).astype(np.float32),
                            (10.0 ** rng.uniform(-14, -2, n)).astype(np.float32)))
        want = torch_adam_step_many(*zip(*tensors), implementation="fused", **kwargs)
        runs.append((kwargs, tensors, [np.concatenate(x) for x in want]))
    return lengths, runs


def _mismatch_mask(runs, variant: AdamVariant, select, *, implementation="fused"):
    """Where the fused replay with ``variant`` everywhere differs from torch, within ``select``."""
    from torch_compat.replay import numpy_adam_step

    masks = []
    for kwargs, tensors, want in runs:
        p, g, m, v = (np.concatenate(x) for x in zip(*tensors))
        uniform = FusedAdamVariant(body=variant, tail=variant, vector_width=VECTOR_WIDTHS[0])
        got = numpy_adam_step(p, g, m, v, variant=uniform, implementation=implementation, **kwargs)
        bad = np.zeros(p.size, bool)
        for a, b in zip(want, got):
            bad |= a.view(np.int32) != b.view(np.int32)
        masks.append(bad & select)
    return np.concatenate(masks)


_DETECTED_IMPL: dict = {}


def detect_fused_variant(refresh: bool = False) -> FusedAdamVariant:
    """Measure torch's fused CPU kernel once per process: the body's op variant on a long
    tensor, then the vector width and the tail's op variant on short tensors of every
    length; confirmed on every calibration coordinate. On no match: a
    ``ReplayVariantWarning`` and ``matched=False``."""
    if "fused" in _DETECTED_IMPL and not refresh:
        return _DETECTED_IMPL["fused"]
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplayVariantWarning)
        base = detect_variant()
    lengths, runs = _fused_calibration_runs()
    position = np.concatenate([np.arange(n) for n in lengths])
    size = np.concatenate([np.full(n, n) for n in lengths])
    every = np.ones(position.size, bool)
    long_body = size == lengths[0]
    candidates = list(_op_candidates(base))
    body = next((c for c in candidates if not _mismatch_mask(runs, c, long_body).any()), None)
    found = None
    if body is not None:
        for width in VECTOR_WIDTHS:
            in_tail = position >= size - size % width
            if _mismatch_mask(runs, body, ~in_tail).any():
                continue
            tail = next((c for c in candidates if not _mismatch_mask(runs, c, in_tail).any()), None)
            if tail is not None:
                found = FusedAdamVariant(body=body, tail=tail, vector_width=width)
                break
    seconds = time.perf_counter() - started
    if found is None:
        detail = ("fused: no modelled op variant reproduces the vector body" if body is None else
                  "fused: no vector width and tail op variant reproduces the scalar tails")
        warnings.warn(f"torch_compat replay matched no modelled fused-kernel variant ({detail}); "
                      "the fused replay may not be bit-exact here", ReplayVariantWarning, stacklevel=2)
        fallback = body or base
        found = FusedAdamVariant(body=fallback, tail=fallback, vector_width=VECTOR_WIDTHS[0], matched=False,
                                 detail=detail)
    else:
        n = int(every.sum()) * len(runs)
        found = dataclasses.replace(found, detail=f"calibrated on {n} coordinates in {seconds:.2f} s")
    _DETECTED_IMPL["fused"] = found
    return found


def detect_foreach_variant(refresh: bool = False) -> AdamVariant:
    """torch's foreach=True Adam on CPU tensors runs the per-tensor ATen kernels of the
    single-tensor path (``_foreach_*`` slow path), in the same order; confirm that end to
    end on this machine rather than assume it. On no match: ``matched=False``."""
    if "foreach" in _DETECTED_IMPL and not refresh:
        return _DETECTED_IMPL["foreach"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplayVariantWarning)
        base = detect_variant()
    problems = _confirm_end_to_end(base, implementation="foreach")
    if problems:
        warnings.warn(f"torch_compat replay does not reproduce torch's foreach Adam ({problems})",
                      ReplayVariantWarning, stacklevel=2)
        variant = dataclasses.replace(base, matched=False, detail="foreach: " + problems)
    else:
        variant = dataclasses.replace(base, detail=base.detail + "; foreach=True confirmed end to end")
    _DETECTED_IMPL["foreach"] = variant
    return variant


def detect_implementation_variant(implementation: str = "single"):
    """The measured variant of ``implementation`` ("single", "foreach" or "fused")."""
    check_implementation(implementation)
    if implementation == "fused":
        return detect_fused_variant()
    if implementation == "foreach":
        return detect_foreach_variant()
    return detect_variant()
