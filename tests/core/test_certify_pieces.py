"""The tiers after the closed form run their rows in calls of a fixed size per stage
(`certify.Stage.rows`), whatever their count, so a training loop's later saves reuse the
programs of its first.  That only moves work: every bound kernel (each fixed level, each
adaptive partition, the cells tiers) gives a row the same bits whatever the size of the call
it is in, on adversarial moments; the probe rejects are not bit-stable across call sizes
(XLA's max over probes drops a NaN in one vector layout and keeps it in another: 0 in one,
6e33 in the other, seen at 256 against 4,096 rows), but at every size a rejected row is one
that no level and no partition certifies, so a reject only skips work.  End to end the guard
escapes the same coordinates with the same codes and per-level counts whatever the sizes."""
import dataclasses

import numpy as np
import pytest

from jaxguard.core import bound, certify, guard, programs
from jaxguard.core.config import GuardConfig
from test_dense_reject import CONFIGS, adversarial

# every size a stage runs at, and the sizes of the ladder the stages replaced
CALL_SIZES = tuple(sorted({64, 256, 1024} | {st.rows for s in (False, True) for ml in (None, -1)
                                            for st in certify.stages("shared", "mixed", max_level=ml, reject_first=s)
                                            if st.rows <= 4096}))


def test_every_setting_has_one_size_a_stage():
    """The programs of a setting are fixed: one (kernel, static, size) per stage, and the
    prepared calls are exactly those."""
    for bnd, part in (("shared", "mixed"), ("shared", "linear"), ("separate", "mixed")):
        for ml in (None, -1, 2):
            st = certify.stages(bnd, part, max_level=ml)
            assert len({(s.kernel, s.static, s.level) for s in st}) == len(st)
            n = 300
            K = bound.stack_rows([bound.pack_constants(GuardConfig(lr=1e-3, step=3).constants(), 0.01)])
            x = np.full(n, 1e-3, np.float32)
            made = certify.stage_calls(K, np.zeros(n, np.int32), x, x, x, x, x, x, bnd, part, max_level=ml)
            assert [(f, np.shape(a[1])[0], tuple(sorted(kw.items()))) for f, a, kw in made] == \
                [(s.kernel, s.rows, s.static) for s in st]


def _rows(seed, n):
    m, v, p = adversarial(seed, n=max(n, 256))
    cfg = GuardConfig(**CONFIGS[seed % len(CONFIGS)])
    with np.errstate(over="ignore"):     # decoded values off by a code or so (inf past the max)
        mt = (m * np.float32(1 + 2.0**-7)).astype(np.float32)
    vt = (v * np.float32(1 - 2.0**-6)).astype(np.float32)
    K = bound.pack_constants(cfg.constants(), cfg.tau)
    K = bound.StepRow(*(np.full(n, x, np.float32) for x in bound.as_step_row(K)))
    clip = np.full(n, cfg.clip, np.float32)
    return K, m[:n], v[:n], mt[:n], vt[:n], np.abs(p[:n]), clip


def _bound_kernels():
    for level in range(len(bound.LEVELS)):
        yield f"level{level}", bound.batch_bound_pc, dict(bound="shared"), (np.asarray(bound.unit_edges(level)),)
    for g in bound.ADAPTIVE_PARTITIONS:
        yield f"adaptive{len(g)}", bound.batch_bound_adaptive_pc, dict(gammas=g), ()


def _call(rows, kernel, sel, *extra, **static):
    K, m, v, mt, vt, pabs, clip = rows
    k = bound.StepRow(*(x[sel] for x in K))
    head = (m[sel], v[sel], mt[sel], vt[sel]) + (() if kernel is bound.batch_lower_pc else (pabs[sel],))
    return np.asarray(kernel(k, *head, clip[sel], *extra, **static))


def _starts(size):
    return sorted({0, 4096 - size, min(1000, 4096 - size)})


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_bound_kernels_give_the_same_bits_at_every_piece_size(seed):
    rows = _rows(seed, 4096)
    for name, kernel, static, extra in _bound_kernels():
        whole = _call(rows, kernel, np.arange(4096), *extra, **static).view(np.uint32)
        for size in CALL_SIZES:
            for start in _starts(size):
                sel = np.arange(start, start + size)
                np.testing.assert_array_equal(_call(rows, kernel, sel, *extra, **static).view(np.uint32), whole[sel],
                                              err_msg=f"{name}, {size} rows from {start}")


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_probe_rejects_are_sound_at_every_piece_size(seed):
    rows = _rows(seed, 4096)
    thr = rows[0].threshold
    certified = np.zeros(4096, bool)
    for _, kernel, static, extra in _bound_kernels():
        out = _call(rows, kernel, np.arange(4096), *extra, **static)
        certified |= (out >= 0) & (out <= thr)
    rejected_somewhere = 0
    for pts in (bound.PROBE_POINTS, bound.DENSE_PROBE_POINTS):
        for size in CALL_SIZES + (4096,):
            for start in _starts(size):
                sel = np.arange(start, start + size)
                rejected = _call(rows, bound.batch_lower_pc, sel, points=pts) > thr[sel]
                assert not (rejected & certified[sel]).any(), (len(pts), size, start)
                rejected_somewhere += int(rejected.sum())
    assert certified.any() and rejected_somewhere > 0     # both sides of the check are exercised


def _encode(m, v, p, cfg, monkeypatch, rows=None, first=None):
    """The guard's encoding with every stage's calls of `rows` rows (default: the stages'
    own), and `certify.TIERED_FIRST_LEVEL` = `first` when given; and the rows the fixed
    levels were handed."""
    handed = []
    fixed = bound.batch_bound_pc

    def counting(k, m_, *a, **s):
        handed.append(np.shape(m_)[0])
        return fixed(k, m_, *a, **s)
    own = certify.stages
    monkeypatch.setattr(programs, "enabled", lambda: False)   # the kernels looked up, not loaded from the cache
    monkeypatch.setattr(bound, "batch_bound_pc", counting)
    if rows is not None:
        monkeypatch.setattr(certify, "stages", lambda *a, **kw: tuple(dataclasses.replace(st, rows=rows)
                                                                      for st in own(*a, **kw)))
    if first is not None:
        monkeypatch.setattr(certify, "TIERED_FIRST_LEVEL", first)
    enc = guard.encode_many([(m, v, p, GuardConfig(**cfg))])[0]
    monkeypatch.undo()
    return enc, sum(handed)


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: ",".join(f"{k}={w}" for k, w in c.items()))
def test_call_sizes_change_no_escape_code_or_level(cfg, monkeypatch):
    m, v, p = adversarial(len(str(cfg)) + 7)
    own, _ = _encode(m, v, p, cfg, monkeypatch)
    for rows in (64, 4096):
        other, _ = _encode(m, v, p, cfg, monkeypatch, rows=rows)
        for k in ("m_codes", "v_codes", "m_params", "v_params", "escape_index"):
            np.testing.assert_array_equal(own.arrays[k], other.arrays[k], err_msg=f"{k}, {rows} rows")
        assert own.stats["certified_by_level"] == other.stats["certified_by_level"]
        assert own.stats["certified_adaptive"] == other.stats["certified_adaptive"]
        assert own.stats["certified_fast_cells"] == other.stats["certified_fast_cells"]
    assert own.stats["escapes"] > 0


def test_the_fixed_levels_are_handed_small_calls(monkeypatch):
    """The positive control of the sizes: the fixed levels (tens of microseconds a row) are
    handed fewer padded rows at their own size than at 1,024 rows a call."""
    rows_own = rows_big = 0
    for cfg in CONFIGS[:3]:
        m, v, p = adversarial(len(str(cfg)) + 7)
        rows_own += _encode(m, v, p, cfg, monkeypatch)[1]
        rows_big += _encode(m, v, p, cfg, monkeypatch, rows=1024)[1]
    assert 0 < rows_own < rows_big, (rows_own, rows_big)


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: ",".join(f"{k}={w}" for k, w in c.items()))
def test_skipping_levels_0_to_2_after_the_adaptive_tier_only_refuses(cfg, monkeypatch):
    """`certify.TIERED_FIRST_LEVEL`: after the adaptive tier levels 0-2 are not walked.  That
    can only leave a coordinate to levels 3-4 (never certify one more), levels 0-2 then count
    nothing, and the fixed levels are handed fewer rows (the point of it)."""
    m, v, p = adversarial(len(str(cfg)) + 11)
    walked, rows_walked = _encode(m, v, p, cfg, monkeypatch, first=0)
    skipped, rows_skipped = _encode(m, v, p, cfg, monkeypatch, first=certify.TIERED_FIRST_LEVEL)
    assert certify.TIERED_FIRST_LEVEL == 3
    assert set(walked.arrays["escape_index"].tolist()) <= set(skipped.arrays["escape_index"].tolist())
    assert skipped.stats["certified_by_level"][:3] == [0, 0, 0]
    assert rows_skipped < rows_walked, (rows_skipped, rows_walked)
    assert walked.stats["escapes"] > 0


def test_the_ablations_still_walk_every_level(monkeypatch):
    """Without the adaptive tier (the linear-partition ablation) all five levels run."""
    cfg = dict(CONFIGS[1], partition="linear")
    m, v, p = adversarial(5)
    enc, _ = _encode(m, v, p, cfg, monkeypatch, first=certify.TIERED_FIRST_LEVEL)
    ref, _ = _encode(m, v, p, cfg, monkeypatch, first=0)
    assert enc.stats["certified_by_level"] == ref.stats["certified_by_level"]
    assert sum(enc.stats["certified_by_level"][:3]) > 0
