"""Finding which FP32 operation variant the installed torch's Adam uses on CPU.

``detect_variant`` calibrates each op (``lerp_``, ``addcmul_``, ``add(alpha=)``: FMA or
not; ``torch.sqrt``: IEEE or the measured table) on crafted inputs that discriminate the
candidates, then confirms the chosen model end to end on a calibration Adam step (body
and scalar tail); ``detect_fused_variant``/``detect_foreach_variant`` do the same for
torch's other CPU implementations. Results are cached per process.

The replay being checked is passed in (`torch_compat.variant.ReplayFunctions`), so the
imports point one way: float32 <- variant <- calibrate <- replay. Users call
`torch_compat.replay.detect_variant` etc., which pass the replay themselves.
"""
from __future__ import annotations

__all__ = ["detect_variant", "detect_fused_variant", "detect_foreach_variant", "detect_implementation_variant"]

import dataclasses
import itertools
import time
import warnings

import numpy as np

from jaxguard.errors import ConfigError
from torch_compat.float32 import MANTISSA_BITS, fma_float32_numpy, sqrt_float32_numpy
from torch_compat.variant import (EDGE_BINADES, SQRT_TABLE_SIZE, VECTOR_WIDTHS, AdamVariant,
                                  FusedAdamVariant, ReplayFunctions, ReplayVariantWarning, SqrtTable,
                                  binade_name, calibration_rng, require_torch, torch_sqrt, check_implementation,
                                  environment_fingerprint, float32_from_bits, ieee_sqrt_table, torch_sqrt_table)

# ---------------------------------------------------------------------------------------
# Calibration


def _exact_fma32(a, b, c) -> np.ndarray:
    return fma_float32_numpy(a, b, c)


def _first_match(observed: np.ndarray, fused: np.ndarray, unfused: np.ndarray) -> bool | None:
    same = lambda x: np.array_equal(observed.view(np.int32), x.view(np.int32))  # noqa: E731
    fused_ok, unfused_ok = same(fused), same(unfused)
    if fused_ok == unfused_ok:
        return None  # neither matched (or the inputs failed to discriminate)
    return fused_ok


def _calibrate_fma_ops(n: int = 20_011) -> dict:
    """Run lerp_, addcmul_ and add(alpha=) on inputs where the fused and unfused results
    differ on thousands of coordinates; report which one torch produced."""
    torch = require_torch()
    rng = calibration_rng()
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
        if not np.array_equal(torch_sqrt(x).view(np.int32), sqrt_float32_numpy(x, table).view(np.int32)):
            unmatched.append(binade_name(exponent))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, -1e-45], np.float32)
    got, want = torch_sqrt(specials), sqrt_float32_numpy(specials, table)
    if not np.array_equal(np.isnan(got), np.isnan(want)) or not np.array_equal(
            got[~np.isnan(got)].view(np.int32), want[~np.isnan(want)].view(np.int32)):
        unmatched.append("zero/inf/nan/negative inputs")
    if unmatched:
        return None, "sqrt: the measured table does not reproduce torch.sqrt on " + ", ".join(unmatched[:6]) + (
            f" (+{len(unmatched) - 6} more)" if len(unmatched) > 6 else "")
    return ("ieee" if table.is_ieee else "mkl-table"), ""


def _calibration_problem(n_body: int = 4096 * 3, n_short: tuple = (1, 3, 7, 15, 17, 31, 33, 100, 255)):
    rng = calibration_rng()
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


def _confirm_end_to_end(replay: ReplayFunctions, variant: AdamVariant, implementation: str = "single") -> str:
    """Compare the replay with torch on calibration Adam/AdamW steps; '' when all equal."""
    problems = []
    for kwargs in (
        dict(step=9, lr=1e-3, weight_decay=0.0, decoupled=False),
        dict(step=0, lr=6e-4, weight_decay=0.01, decoupled=False),
        dict(step=999, lr=1e-3, weight_decay=0.1, decoupled=True),
    ):
        tensors = _calibration_problem()
        # torch steps each tensor separately (own scalar tail); the replay is elementwise
        want = [np.concatenate(x) for x in replay.torch_adam_step_many(*zip(*tensors), implementation=implementation,
                                                                **kwargs)]
        got = replay.adam_step(*(np.concatenate(x) for x in zip(*tensors)), variant=variant, **kwargs)
        for name, a, b in zip("pmv", want, got):
            bad = int(np.count_nonzero(a.view(np.int32) != b.view(np.int32)))
            if bad:
                problems.append(f"{name}: {bad}/{a.size} differ ({kwargs})")
    return "; ".join(problems[:3])


_DETECTED: AdamVariant | None = None


def detect_variant(replay: ReplayFunctions, refresh: bool = False) -> AdamVariant:
    """Calibrate the installed torch once per process and return the matching variant.

    On no match: a ``ReplayVariantWarning``, ``matched=False``, and the documented default
    model (every op fused, measured sqrt table when it is within 1 ulp, else IEEE).

    Args:
      replay: the replay's op functions (`torch_compat.replay` passes its own `ReplayFunctions`).
      refresh: measure again even if this process already did.

    Returns:
      The matching `AdamVariant` (cached for the process).

    Raises:
      ConfigError: torch is not installed.
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
    end_to_end = _confirm_end_to_end(replay, variant)
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


def _fused_calibration_runs(replay: ReplayFunctions):
    """Real fused torch steps on one long tensor (all vector body for every candidate
    width) and short tensors of every length 1..127 (scalar tails)."""
    lengths = (64 * 192,) + tuple(range(1, 128)) * 2
    rng = calibration_rng()
    runs = []
    for kwargs in FUSED_CALIBRATION:
        tensors = []
        for n in lengths:
            tensors.append(((rng.standard_normal(n) * 0.05).astype(np.float32),
                            (rng.standard_normal(n) * 0.02).astype(np.float32),
                            (rng.standard_normal(n) * 1e-3).astype(np.float32),
                            (10.0 ** rng.uniform(-14, -2, n)).astype(np.float32)))
        want = replay.torch_adam_step_many(*zip(*tensors), implementation="fused", **kwargs)
        runs.append((kwargs, tensors, [np.concatenate(x) for x in want]))
    return lengths, runs


def _mismatch_mask(replay: ReplayFunctions, runs, variant: AdamVariant, select, *, implementation="fused"):
    """Where the fused replay with ``variant`` everywhere differs from torch, within ``select``."""
    masks = []
    for kwargs, tensors, want in runs:
        p, g, m, v = (np.concatenate(x) for x in zip(*tensors))
        uniform = FusedAdamVariant(body=variant, tail=variant, vector_width=VECTOR_WIDTHS[0])
        got = replay.numpy_adam_step(p, g, m, v, variant=uniform, implementation=implementation, **kwargs)
        bad = np.zeros(p.size, bool)
        for a, b in zip(want, got):
            bad |= a.view(np.int32) != b.view(np.int32)
        masks.append(bad & select)
    return np.concatenate(masks)


_DETECTED_IMPL: dict = {}


def detect_fused_variant(replay: ReplayFunctions, refresh: bool = False) -> FusedAdamVariant:
    """Measure torch's fused CPU kernel once per process: the body's op variant on a long
    tensor, then the vector width and the tail's op variant on short tensors of every
    length; confirmed on every calibration coordinate. On no match: a
    ``ReplayVariantWarning`` and ``matched=False``.

    Args:
      replay: the replay's op functions (`torch_compat.replay` passes its own `ReplayFunctions`).
      refresh: measure again even if this process already did.

    Returns:
      The `FusedAdamVariant` (body, vector width, tail), cached for the process.

    Raises:
      ConfigError: torch is not installed.
    """
    if "fused" in _DETECTED_IMPL and not refresh:
        return _DETECTED_IMPL["fused"]
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplayVariantWarning)
        base = detect_variant(replay)
    lengths, runs = _fused_calibration_runs(replay)
    position = np.concatenate([np.arange(n) for n in lengths])
    size = np.concatenate([np.full(n, n) for n in lengths])
    every = np.ones(position.size, bool)
    long_body = size == lengths[0]
    candidates = list(_op_candidates(base))
    body = next((c for c in candidates if not _mismatch_mask(replay, runs, c, long_body).any()), None)
    found = None
    if body is not None:
        for width in VECTOR_WIDTHS:
            in_tail = position >= size - size % width
            if _mismatch_mask(replay, runs, body, ~in_tail).any():
                continue
            tail = next((c for c in candidates if not _mismatch_mask(replay, runs, c, in_tail).any()), None)
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


def detect_foreach_variant(replay: ReplayFunctions, refresh: bool = False) -> AdamVariant:
    """torch's foreach=True Adam on CPU tensors runs the per-tensor ATen kernels of the
    single-tensor path (``_foreach_*`` slow path), in the same order; confirm that end to
    end on this machine rather than assume it. On no match: ``matched=False``.

    Args:
      replay: the replay's op functions (`torch_compat.replay` passes its own `ReplayFunctions`).
      refresh: measure again even if this process already did.

    Returns:
      The single-tensor `AdamVariant`, with ``matched=False`` if foreach disagrees.

    Raises:
      ConfigError: torch is not installed.
    """
    if "foreach" in _DETECTED_IMPL and not refresh:
        return _DETECTED_IMPL["foreach"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplayVariantWarning)
        base = detect_variant(replay)
    problems = _confirm_end_to_end(replay, base, implementation="foreach")
    if problems:
        warnings.warn(f"torch_compat replay does not reproduce torch's foreach Adam ({problems})",
                      ReplayVariantWarning, stacklevel=2)
        variant = dataclasses.replace(base, matched=False, detail="foreach: " + problems)
    else:
        variant = dataclasses.replace(base, detail=base.detail + "; foreach=True confirmed end to end")
    _DETECTED_IMPL["foreach"] = variant
    return variant


def detect_implementation_variant(replay: ReplayFunctions, implementation: str = "single"):
    """The measured variant of ``implementation`` ("single", "foreach" or "fused").

    Args:
      replay: the replay's op functions (`torch_compat.replay` passes its own `ReplayFunctions`).
      implementation: ``"single"``, ``"foreach"`` or ``"fused"``.

    Returns:
      An `AdamVariant` (single, foreach) or a `FusedAdamVariant` (fused).

    Raises:
      ConfigError: an unknown implementation, or torch is not installed.
    """
    check_implementation(implementation)
    if implementation == "fused":
        return detect_fused_variant(replay)
    if implementation == "foreach":
        return detect_foreach_variant(replay)
    return detect_variant(replay)
