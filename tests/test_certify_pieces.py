"""The tiers after the closed form run their few coordinates in pieces of 64, 256 or 1,024
rows (`certify.piece_sizes`), not padded to 256 or 1,024.  That only moves work: every
bound kernel (each fixed level, each adaptive partition) gives a row the same bits whatever
the size of the call it is in, on adversarial moments; the probe rejects are not
bit-stable across call sizes (XLA's max over probes drops a NaN in one vector layout and
keeps it in another: 0 in one, 6e33 in the other, seen at 256 against 4,096 rows, also
before this change), but at every size a rejected row is one that no level and no partition
certifies, so a reject only skips work.  End to end the guard escapes the same coordinates
with the same codes and per-level counts as with one piece size, while the fixed levels are
handed fewer padded rows."""
import numpy as np
import pytest

from jaxguard.core import bound, certify, guard, programs
from jaxguard.core.config import GuardConfig
from test_dense_reject import CONFIGS, adversarial


@pytest.mark.parametrize("chunk", [64, 256, 1024, 2048, 4096, 65536])
def test_piece_sizes_hold_every_coordinate_in_known_shapes(chunk):
    shapes = {s for s in certify.PIECE_SIZES if s < chunk} | {chunk}
    for count in list(range(0, 300)) + [chunk - 1, chunk, chunk + 1, 3 * chunk + 777]:
        sizes = certify.piece_sizes(count, chunk)
        assert sum(sizes) >= count and set(sizes) <= shapes, (count, sizes)
        assert sizes[:count // chunk] == [chunk] * (count // chunk)
        assert sum(sizes) - count < min(shapes) + max(s for s in shapes if s <= max(count % chunk, min(shapes))), \
            (count, sizes)
    assert certify.piece_sizes(12, chunk) == [min(64, chunk)]


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
        for size in certify.PIECE_SIZES:
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
        for size in certify.PIECE_SIZES + (4096,):
            for start in _starts(size):
                sel = np.arange(start, start + size)
                rejected = _call(rows, bound.batch_lower_pc, sel, points=pts) > thr[sel]
                assert not (rejected & certified[sel]).any(), (len(pts), size, start)
                rejected_somewhere += int(rejected.sum())
    assert certified.any() and rejected_somewhere > 0     # both sides of the check are exercised


def _encode(m, v, p, cfg, monkeypatch, sizes=certify.PIECE_SIZES, first=None):
    """The guard's encoding with these piece sizes (and `certify.TIERED_FIRST_LEVEL` = `first`
    when given), and the rows the fixed levels were handed."""
    rows = []
    fixed = bound.batch_bound_pc

    def counting(k, m_, *a, **s):
        rows.append(np.shape(m_)[0])
        return fixed(k, m_, *a, **s)
    monkeypatch.setattr(programs, "enabled", lambda: False)   # the kernels looked up, not loaded from an export
    monkeypatch.setattr(bound, "batch_bound_pc", counting)
    monkeypatch.setattr(certify, "PIECE_SIZES", sizes)
    if first is not None:
        monkeypatch.setattr(certify, "TIERED_FIRST_LEVEL", first)
    enc = guard.encode_many([(m, v, p, GuardConfig(**cfg))])[0]
    monkeypatch.undo()
    return enc, sum(rows)


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: ",".join(f"{k}={w}" for k, w in c.items()))
def test_pieces_change_no_escape_code_or_level(cfg, monkeypatch):
    m, v, p = adversarial(len(str(cfg)) + 7)
    ladder, _ = _encode(m, v, p, cfg, monkeypatch, certify.PIECE_SIZES)
    one, _ = _encode(m, v, p, cfg, monkeypatch, (certify.SMALL_CHUNK,))
    for k in ("m_codes", "v_codes", "m_params", "v_params", "escape_index"):
        np.testing.assert_array_equal(ladder.arrays[k], one.arrays[k], err_msg=k)
    assert ladder.stats["certified_by_level"] == one.stats["certified_by_level"]
    assert ladder.stats["certified_adaptive"] == one.stats["certified_adaptive"]
    assert ladder.stats["escapes"] > 0


def test_pieces_hand_the_fixed_levels_fewer_rows(monkeypatch):
    """The positive control: with one piece size the same coordinates cost more padded rows."""
    rows_ladder = rows_one = 0
    for cfg in CONFIGS[:3]:
        m, v, p = adversarial(len(str(cfg)) + 7)
        rows_ladder += _encode(m, v, p, cfg, monkeypatch, certify.PIECE_SIZES)[1]
        rows_one += _encode(m, v, p, cfg, monkeypatch, (certify.SMALL_CHUNK,))[1]
    assert rows_ladder < rows_one, (rows_ladder, rows_one)


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
