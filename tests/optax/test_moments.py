"""`jaxguard.moments.MomentJob`, the one moment-pair type: what `optax_state.lay_out` hands
every writer (identity, config, mu mode), and the static view the jit hook keys on (no
arrays: two states of one layout give equal, hashable keys)."""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxguard.core.config import GuardSpec, UpdateRequest
from jaxguard.moments import MomentJob, MomentStatic
from jaxguard.optax_state import lay_out


def _state(mu_dtype=None, seed=0):
    params = {"a": jnp.asarray(np.random.default_rng(seed).normal(size=(3, 5)), jnp.float32),
              "b": jnp.ones((7,), jnp.float32)}
    return optax.adam(1e-3, mu_dtype=mu_dtype).init(params), params


def _layout(state, params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # saved without tx: nothing checked (a JaxguardWarning)
        return lay_out(state, params, spec=GuardSpec(), update=UpdateRequest(lr=1e-3))


def test_lay_out_hands_each_certified_pair_as_a_moment_job():
    state, params = _state()
    jobs = _layout(state, params).coded
    assert [type(j) for j in jobs] == [MomentJob, MomentJob]
    a = next(j for j in jobs if j.param == "a")
    assert (a.name, a.mu_path, a.nu_path, a.shape, a.mu, a.mu_mode) == (
        "state/moments/0.mu.a", "0.mu.a", "0.nu.a", (3, 5), "coded", "coded")
    assert a.info == {"param": "a"} and a.size == 15 and a.config.lr == 1e-3
    assert a.m is state[0].mu["a"] and a.p is params["a"]


def test_a_bfloat16_mu_is_an_exact_job_beside_its_raw_entry():
    state, params = _state(mu_dtype=jnp.bfloat16)
    b = next(j for j in _layout(state, params).coded if j.param == "b")
    assert (b.mu, b.mu_mode, b.raw_entry) == ("exact", "raw-bfloat16", "state/0.mu.b")


def test_the_static_view_holds_no_arrays_and_is_one_key_for_one_layout():
    s1, p1 = _state(seed=0)
    s2, p2 = _state(seed=1)
    k1 = [j.static(row) for row, j in enumerate(_layout(s1, p1).coded)]
    k2 = [j.static(row) for row, j in enumerate(_layout(s2, p2).coded)]
    assert all(isinstance(k, MomentStatic) for k in k1)
    assert hash(tuple(k1)) == hash(tuple(k2)) and tuple(k1) == tuple(k2)
    fields = [getattr(k, f.name) for k in k1 for f in dataclasses.fields(k)]
    assert not any(isinstance(x, (jax.Array, np.ndarray)) for x in fields)
    assert k1[0].spec == GuardSpec(op_model=k1[0].spec.op_model)   # the static part of the config only
