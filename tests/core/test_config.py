"""GuardConfig = static GuardSpec + per-step constants; certification as an option; the
core codec table; Encoded stats inside the pytree; the typed StepRow."""
import dataclasses

import jax
import numpy as np
import pytest

import jaxguard.core.guard as G
from jaxguard.core import bound, codecs, jit_encode
from jaxguard.core.config import GuardConfig, GuardSpec
from jaxguard.errors import ConfigError
from jaxguard.format import spec


def _moments(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n).astype(np.float32) ** 2) * np.float32(1e-6)
    m = (rng.standard_normal(n).astype(np.float32) * np.sqrt(v) * np.float32(0.3)).astype(np.float32)
    p = rng.standard_normal(n).astype(np.float32)
    m[:3] = [np.nan, 0.0, -0.0]
    return m, v, p


def test_spec_is_static_and_ignores_per_step_values():
    a = GuardConfig(lr=1e-3, step=10, codec="log8")
    b = dataclasses.replace(a, lr=3e-4, step=500, betas=(0.8, 0.99), eps=1e-6)
    assert a.spec == b.spec and hash(a.spec) == hash(b.spec)
    assert a.constants() != b.constants() and a.constants().lr == 1e-3
    assert isinstance(a.spec, GuardSpec) and a.spec.certify
    assert dataclasses.replace(a, tau=0.02).spec != a.spec


def test_old_header_dict_parses_and_round_trips():
    old = {"lr": 0.001, "step": 3, "tau": 0.01, "clip": 0.2, "betas": [0.9, 0.999], "eps": 1e-08,
           "weight_decay": 0.0, "op_model": "torch-adam", "codec": "log8-rel", "bound": "shared",
           "partition": "mixed", "joint": False}           # written before `certify` existed
    cfg = GuardConfig.from_json(old)
    assert cfg.certify and cfg.to_json() == old             # default headers unchanged
    off = dataclasses.replace(cfg, certify=False)
    assert off.to_json()["certify"] is False and GuardConfig.from_json(off.to_json()) == off


def test_bad_certify_is_one_clear_error():
    with pytest.raises(ConfigError, match="certify"):
        GuardConfig(lr=1e-3, step=1, certify="yes")


def test_block8_unguarded_is_block8_without_the_guard():
    m, v, p = _moments()
    alias = G.encode(m, v, p, GuardConfig(lr=1e-3, step=10, codec="block8-unguarded"))
    option = G.encode(m, v, p, GuardConfig(lr=1e-3, step=10, codec="block8", certify=False))
    guarded = G.encode(m, v, p, GuardConfig(lr=1e-3, step=10, codec="block8"))
    assert alias.codec == option.codec == "block8-unguarded"
    assert not spec.get(alias.codec).certified and spec.get(alias.codec).decode == "block8"
    for k in alias.arrays:
        assert alias.arrays[k].tobytes() == option.arrays[k].tobytes(), k
    assert np.array_equal(alias.arrays["m_codes"], guarded.arrays["m_codes"])   # same codes, fewer escapes
    assert alias.stats["escapes"] < guarded.stats["escapes"]
    assert alias.stats["escapes"] == alias.stats["uncertifiable"]               # only what cannot be coded
    assert set(alias.stats) == set(guarded.stats)


@pytest.mark.parametrize("codec", ["log8", "log8-rel", "bf16", "logrel-aw"])
def test_certify_false_skips_the_guard_for_any_codec(codec):
    m, v, p = _moments()
    on = G.encode(m, v, p, GuardConfig(lr=1e-3, step=10, codec=codec))
    off = G.encode(m, v, p, GuardConfig(lr=1e-3, step=10, codec=codec, certify=False))
    assert off.codec == codec
    assert off.stats["escapes"] == off.stats["uncertifiable"] <= on.stats["escapes"]
    assert sum(off.stats["certified_by_level"]) == 0 and off.stats["certified_fast"] == 0
    mt, vt = G.decode(off)
    assert np.isnan(mt[0])   # the NaN still escapes exactly


def test_codec_table_keys_are_the_registry_ids():
    assert tuple(codecs.TABLE) == spec.codec_ids() == tuple(spec.CODECS)
    for cid, entry in codecs.TABLE.items():
        assert (entry.propose is None) != (entry.choose is None), cid
    assert codecs.TABLE["block8-unguarded"].decode_blocks is codecs.TABLE["block8"].decode_blocks
    assert codecs.TABLE["logrel-aw"].decode_blocks is codecs.TABLE["log8-rel"].decode_blocks
    with pytest.raises(ConfigError, match="unknown"):
        codecs.get("log9")


def test_encoded_stats_survive_tree_map():
    m, v, p = _moments()
    enc = G.encode(m, v, p, GuardConfig(lr=1e-3, step=10, codec="log8-rel"))   # fixed widths: no widths array
    leaves = jax.tree_util.tree_leaves(enc)
    assert any(x is enc.stats["escapes"] or (np.ndim(x) == 0 and x == enc.stats["escapes"]) for x in leaves)
    same = jax.tree_util.tree_map(lambda x: x, enc)
    assert same.stats == enc.stats and same.codec == enc.codec and same.shape == enc.shape
    doubled = jax.tree_util.tree_map(lambda x: x * 2, enc)
    assert doubled.stats["escapes"] == 2 * enc.stats["escapes"]
    assert np.array_equal(doubled.m_params, 2 * enc.m_params)
    for name in ("m_codes", "v_codes", "m_params", "v_params", "escape_index", "escape_m", "escape_v"):
        assert getattr(enc, name) is enc.arrays[name]
    assert enc.widths is None


def test_step_row_is_a_pytree_and_gathers_by_name():
    rows = [GuardConfig(lr=lr, step=s).step_row() for lr, s in ((1e-3, 1), (2e-3, 7), (5e-4, 100))]
    assert rows[1].lr == np.float32(2e-3) and rows[1].threshold == np.float32(np.float32(0.01) * np.float32(2e-3)) \
        * np.float32(1 - 2.0**-22)
    K = bound.stack_rows(rows)
    taken = K.take(np.array([2, 0, 2]))
    assert np.array_equal(taken.S, np.array([rows[2].S, rows[0].S, rows[2].S]))
    assert len(jax.tree_util.tree_leaves(K)) == len(bound.StepRow._fields) == 12
    jk = jax.tree_util.tree_map(lambda x: jax.numpy.asarray(x), K)
    assert np.array_equal(np.asarray(jk.take(np.array([1])).eps), K.eps[[1]])


def test_jit_encode_keys_on_the_spec_not_the_step():
    m, v, p = (jax.numpy.asarray(x) for x in _moments(1024))
    before = jit_encode.encode_jitted._cache_size()
    outs = [jit_encode.encode_jit(m, v, p, GuardConfig(lr=lr, step=s), capacity=256) for lr, s in ((1e-3, 1), (3e-4, 90))]
    assert jit_encode.encode_jitted._cache_size() - before <= 1      # one compile for both steps
    for cfg, je in zip((GuardConfig(lr=1e-3, step=1), GuardConfig(lr=3e-4, step=90)), outs):
        enc = G.encode(np.asarray(m), np.asarray(v), np.asarray(p), cfg)
        got = jit_encode.to_encoded(je, m, v)
        assert np.array_equal(got.arrays["m_codes"], enc.arrays["m_codes"])
        assert set(got.arrays["escape_index"].tolist()) >= set(enc.arrays["escape_index"].tolist()) - set()
    legacy = jit_encode.constants(GuardConfig(lr=1e-3, step=1))
    assert isinstance(legacy, bound.StepRow)


def test_to_encoded_adds_no_escape_for_an_exactly_coded_nan():
    """bf16 codes the canonical NaN bit-exactly: guard.encode keeps it coded, and the host
    re-check of the jit path (floatbits: NaN is not tiny) now agrees instead of adding it."""
    m, v, p = _moments(1024)
    v[1] = np.nan
    cfg = GuardConfig(lr=1e-3, step=9, codec="bf16")
    host = G.encode(m, v, p, cfg)
    got = jit_encode.to_encoded(jit_encode.encode_jit(*(jax.numpy.asarray(x) for x in (m, v, p)), cfg), m, v)
    assert 1 not in host.arrays["escape_index"] and 1 not in got.arrays["escape_index"]
    assert np.isnan(G.decode(got)[1][1]) and G.decode(got)[1][1].tobytes() == v[1].tobytes()
