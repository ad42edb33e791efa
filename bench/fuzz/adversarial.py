"""Timed adversarial search for guarantee violations (issue 10), torch and optax.

Usage:
    PYTHONPATH=$PWD python bench/fuzz/adversarial.py --minutes 10          # bench/results/adversarial.{json,md}
    PYTHONPATH=$PWD python bench/fuzz/adversarial.py --minutes 1 --seed 1 --out /tmp/adv   # quick
    PYTHONPATH=$PWD python bench/fuzz/adversarial.py --minutes 5 --seed 25 --codecs logrel-ans,logrel-aw
                                                    # bench/results/adversarial_logrel-ans.{json,md}

30% of the cases are targeted at the families of issue 10's counterexamples
(`targeted_case`).  The others: a state of 512 or 1024 coordinates made of 256-blocks, each block drawn from
a mixture (ordinary trained-looking moments, moments near FLT_MAX, on both sides of the
overflow boundaries FLT_MAX*B, FLT_MAX*bc2 and bound.NATIVE_LIMIT (*bc2), subnormal and
zero moments, huge parameters), with random hyperparameters (lr 1e-5..10, weight decay
0 or up to lr*wd = 30, betas including 0.0, 0.99999 and torch's 0.99999999, eps down to
1e-30, steps 0..1e5), tau and C far from the defaults, and a guarded codec (`--codecs`).  It is
saved and loaded through the public adapters (`torch_compat.save`/`load` of a real
torch.optim.Adam/AdamW; `jaxguard.save`/`load` of a real optax inject_hyperparams(adamw)
state), and the first real update from both states is compared on a dense gradient grid
over [-C, C] (129 linear points, 2 x 81 geometric ones down to 2**-40 C, +-C, one ulp
inside, the smallest normal and subnormal) plus one uniform per-coordinate draw.

Per-group rates and lr intervals (issue 55): a third of the untargeted cases split their
coordinates into two parameters in two groups at rates 1e-3..1e3 apart (torch: two param
groups; optax: `multi_transform` of two inject_hyperparams(adamw), saved with ``tx=`` so
the rates are read from the transformation), another third certify an interval
``lr=(lr/r, lr)`` with r in {10, 100, 1000} and replay it at the low end, the high end,
their geometric mean and a rate drawn between; every gap is measured in the rate of its
own step.

A violation: a coordinate whose restored update differs from the original's by more than
tau*lr for some gradient (a NaN on one side only, or inf against a number, counts).  A
ConfigError raised for the hyperparameters is recorded (the contract allows a one-line
error) and the case is skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
CODECS = ("log8-rel", "log8", "bf16", "block8")
BETAS_TORCH = ((0.9, 0.999), (0.5, 0.9), (0.0, 0.99), (0.99, 0.99999), (0.9, 0.99999999), (0.999999, 0.999))
BETAS_OPTAX = ((0.9, 0.999), (0.5, 0.9), (0.0, 0.99), (0.99, 0.99999), (0.9, 0.99999999))
EPS = (1e-8, 1e-6, 1e-12, 1e-30)
STEPS = (0, 1, 2, 10, 100, 1000, 100000)


def grid(clip):
    c = np.float32(clip)
    lin = np.linspace(-clip, clip, 129)
    logs = clip * 2.0 ** -np.linspace(0, 40, 81)
    ext = [c, np.nextafter(c, np.float32(0)), np.float32(2.0**-126), np.float32(2.0**-149)]
    g = np.concatenate([lin, logs, -logs, ext, -np.asarray(ext, np.float64), [0.0]])
    return np.unique(g.astype(np.float32))


def draw_block(rng, n, B2, bc2):
    """One block of (m, v, p) from the mixture (float32, finite, v >= 0)."""
    from jaxguard.core import bound
    NATIVE_LIMIT = getattr(bound, "NATIVE_LIMIT", 2.0**120)   # (also runs against the code before issue 10)
    kind = rng.choice(["ordinary", "flt_max", "boundary", "tiny", "wide", "huge_p"], p=[.3, .15, .25, .1, .1, .1])
    sgn = rng.choice([-1.0, 1.0], n)
    if kind == "ordinary":
        m = 10 ** rng.uniform(-6, -1, n)
        v = m**2 * 10 ** rng.uniform(-1, 3, n)
    elif kind == "flt_max":
        v = FLT_MAX * 10 ** rng.uniform(-4, 0, n)
        m = np.sqrt(v) * 10 ** rng.uniform(-2, 1.5, n)
    elif kind == "boundary":
        centre = rng.choice([FLT_MAX * B2**0.5, FLT_MAX * bc2, NATIVE_LIMIT, NATIVE_LIMIT * bc2, FLT_MAX])
        v = centre * np.exp(rng.uniform(-1, 1, n))
        m = np.sqrt(v) * 10 ** rng.uniform(-2, 1, n)
    elif kind == "tiny":
        v = 2.0 ** rng.uniform(-149, -60, n)
        m = 2.0 ** rng.uniform(-149, -40, n)
    elif kind == "wide":
        v = 2.0 ** rng.uniform(-140, 127.9, n)
        m = np.sqrt(v) * 10 ** rng.uniform(-3, 1, n)
    else:
        m = 10 ** rng.uniform(-4, 1, n)
        v = m**2 * 10 ** rng.uniform(-1, 2, n)
    r = rng.random(n)
    m = np.where(r < 0.05, 0.0, m)
    v = np.where((r > 0.05) & (r < 0.08), 0.0, v)
    p = sgn * 10 ** rng.uniform(-3, 2, n) * rng.choice([-1.0, 1.0], n)
    if kind == "huge_p" or rng.random() < 0.2:
        p = p * 10 ** rng.uniform(3, 38, n)
    f = lambda x: np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32)  # noqa: E731
    with np.errstate(over="ignore"):
        return f(m * sgn), f(v), f(p), str(kind)


def targeted_case(rng, framework):
    """The families of issue 10's counterexamples, randomised: (a) torch AdamW with
    lr*wd in 2.2..12, |p| 1e4..1e6, m ~ 1e-3, v ~ 50..100 m^2; (b) blocks with half the v
    at an overflow boundary (FLT_MAX*B, FLT_MAX*bc2) and half down to 1e-30 (coarse log
    codes), m ~ sqrt(v) x 0.05..5, default hyperparameters at small counts."""
    n = 512
    sgn = rng.choice([-1.0, 1.0], n)
    if framework == "torch" and rng.random() < 0.5:
        lr = float(10 ** rng.uniform(-1, 0.5))
        m = sgn * 10 ** rng.uniform(-3.5, -2.5, n)
        v = m**2 * rng.uniform(50, 100, n)
        p = rng.choice([-1.0, 1.0], n) * 10 ** rng.uniform(4, 6, n)
        c = {"lr": lr, "wd": float(rng.uniform(2.2, 12) / lr), "betas": (0.9, 0.999), "eps": 1e-8,
             "step": int(rng.choice([10, 100, 1000])), "decoupled": True, "blocks": ["targeted-decay"] * 2}
    else:
        step = int(rng.choice([0, 1, 3, 30]))
        bc2 = 1 - 0.999 ** (step + 1)
        centre = float(rng.choice([FLT_MAX * math.sqrt(bc2), FLT_MAX * bc2]))
        v = np.exp(rng.uniform(math.log(float(rng.choice([1e-30, 1e-10, 1e10]))), math.log(1e35), n))
        v[::2] = centre * np.exp(rng.uniform(-0.7, 0.7, n // 2))
        m = sgn * np.sqrt(v) * rng.uniform(0.05, 5, n)
        p = rng.uniform(-100, 100, n)
        c = {"lr": 1e-3, "wd": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "step": step, "decoupled": False,
             "blocks": ["targeted-overflow"] * 2}
    f = lambda x: np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32)  # noqa: E731
    with np.errstate(over="ignore"):
        c.update(framework=framework, tau=0.01, clip=0.2, codec=str(rng.choice([x for x in CODECS if x in ("log8-rel", "log8")] or list(CODECS))), m=f(m), v=f(v),
                 p=f(p))
    return c


def draw_case(rng, framework):
    if rng.random() < 0.3:
        return targeted_case(rng, framework)
    lr = float(10 ** rng.uniform(-5, 1))
    wd = 0.0 if rng.random() < 0.4 else float(10 ** rng.uniform(-4, math.log10(30.0)) / (lr if rng.random() < 0.5 else 1))
    wd = min(wd, 1e6)
    table = BETAS_TORCH if framework == "torch" else BETAS_OPTAX
    betas = table[rng.integers(0, len(table))]
    step = int(rng.choice(STEPS))
    t = step + 1
    bc2 = 1 - np.float32(betas[1]) ** t
    B2 = max(float(bc2), 1e-30)
    n = int(rng.choice([512, 1024]))
    blocks = [draw_block(rng, 256, B2, max(float(bc2), 1e-30)) for _ in range(n // 256)]
    m, v, p = (np.concatenate([b[i] for b in blocks]) for i in range(3))
    mode = str(rng.choice(["point", "groups", "interval"]))
    c = {"framework": framework, "lr": lr, "wd": wd, "betas": betas, "eps": float(rng.choice(EPS)), "step": step,
         "tau": float(rng.choice([0.01, 0.1, 1e-3])), "clip": float(rng.choice([0.2, 1.0, 1e-3, 100.0])),
         "codec": str(rng.choice(CODECS)), "decoupled": bool(rng.random() < 0.5),
         "blocks": [b[3] for b in blocks], "m": m, "v": v, "p": p, "mode": mode}
    if mode == "groups":       # the second half of the coordinates: another group, another rate
        c["lr_b"] = float(min(lr * 10 ** rng.uniform(-3, 3), 10.0))
        if framework == "optax":   # rates read from tx= are certified for lr <= 1 and lr wd <= 1 (docs/bound.md 10)
            c["lr"], c["lr_b"] = min(c["lr"], 0.5), min(c["lr_b"], 0.5)
            c["wd"] = min(c["wd"], 0.5 / max(c["lr"], c["lr_b"]))
    elif mode == "interval":   # certified for [lr/r, lr], replayed across it
        hi = min(lr, 1.0)
        lo = hi / float(rng.choice([10.0, 100.0, 1000.0]))
        c.update(lr=hi, lr_lo=lo, wd=min(wd, 1.0 / hi),
                 replay=sorted({lo, math.sqrt(lo * hi), hi, float(np.exp(rng.uniform(math.log(lo), math.log(hi))))}))
    return c


def case_rates(c):
    """[(rates of the two halves of the coordinates)] the case replays: one pair for a
    point or groups case, one per rate of an interval case (both halves alike)."""
    if c.get("mode") == "interval":
        return [(r, r) for r in c["replay"]]
    return [(c["lr"], c.get("lr_b", c["lr"]))]


def gaps(a, b, lr):
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(all="ignore"):
        return np.where(same, 0.0, np.nan_to_num(np.abs(a - b) / lr, nan=np.inf, posinf=np.inf))


# ---------------------------------------------------------------- torch
def torch_case(c, tmp):
    import torch
    import torch_compat
    cls = torch.optim.AdamW if c["decoupled"] else torch.optim.Adam
    kw = dict(betas=c["betas"], eps=c["eps"], weight_decay=c["wd"], foreach=False, fused=False)
    half = c["p"].size // 2 if c.get("mode") == "groups" else c["p"].size
    parts = [slice(0, half), slice(half, c["p"].size)] if half < c["p"].size else [slice(0, c["p"].size)]

    def opt_with(p, m, v, rates):
        Ps = [torch.nn.Parameter(torch.from_numpy(np.array(p[..., sl]))) for sl in parts]
        o = cls([{"params": [P], "lr": r} for P, r in zip(Ps, rates)], **kw)
        for P, sl in zip(Ps, parts):
            o.state[P] = {"step": torch.tensor(float(c["step"])), "exp_avg": torch.from_numpy(np.array(m[..., sl])),
                          "exp_avg_sq": torch.from_numpy(np.array(v[..., sl]))}
        return Ps, o

    rates0 = case_rates(c)[0] if c.get("mode") != "interval" else (c["lr"], c["lr"])
    _, o = opt_with(c["p"], c["m"], c["v"], rates0[:len(parts)])
    given = (c["lr_lo"], c["lr"]) if c.get("mode") == "interval" else None
    s = torch_compat.save(os.path.join(tmp, "t.jg"), o, tau=c["tau"], clip=c["clip"], codec=c["codec"], lr=given)
    Ps2, _ = opt_with(c["p"], c["m"], c["v"], rates0[:len(parts)])
    o2 = torch_compat.load(os.path.join(tmp, "t.jg"), cls([{"params": [P], "lr": r} for P, r in
                                                           zip(Ps2, rates0[:len(parts)])], **kw))
    mt = np.concatenate([o2.state[P]["exp_avg"].numpy() for P in Ps2])
    vt = np.concatenate([o2.state[P]["exp_avg_sq"].numpy() for P in Ps2])
    g = grid(c["clip"])
    rng = np.random.default_rng(0)
    G = np.concatenate([np.repeat(g[:, None], c["p"].size, 1),
                        rng.uniform(-c["clip"], c["clip"], (1, c["p"].size)).astype(np.float32)])

    def run(m, v, rates):
        Ps, o = opt_with(np.tile(c["p"], (G.shape[0], 1)), np.tile(m, (G.shape[0], 1)), np.tile(v, (G.shape[0], 1)),
                         rates[:len(parts)])
        for P, sl in zip(Ps, parts):
            P.grad = torch.from_numpy(np.ascontiguousarray(G[:, sl]))
        with np.errstate(all="ignore"):
            o.step()
        return np.concatenate([P.detach().numpy().astype(np.float64) for P in Ps], 1)

    worst = np.zeros(c["p"].size)
    for rates in case_rates(c):
        lr_of = np.concatenate([np.full(sl.stop - sl.start, r) for sl, r in zip(parts, rates)])
        worst = np.maximum(worst, gaps(run(c["m"], c["v"], rates), run(mt, vt, rates), lr_of).max(0))
    return s, worst, mt, vt


# ---------------------------------------------------------------- optax
_OPTAX = {}


def _optax_tx(c, groups):
    import jax
    import optax
    key = (c["betas"], c["eps"], groups)
    if key not in _OPTAX:
        inner = lambda: optax.inject_hyperparams(optax.adamw, static_args=("b1", "b2", "eps", "mu_dtype", "nesterov"))(  # noqa: E731
            learning_rate=1e-3, b1=c["betas"][0], b2=c["betas"][1], eps=c["eps"], weight_decay=0.0)
        tx = optax.multi_transform({"a": inner(), "b": inner()}, {"a": "a", "b": "b"}) if groups else inner()

        @jax.jit
        def step(state, params, g):
            u, _ = tx.update(g, state, params)
            return optax.apply_updates(params, u)
        _OPTAX[key] = (tx, step)
    return _OPTAX[key]


def _optax_state(tx, c, params, rates, groups):
    """`tx`'s state with the case's moments, count and per-group rates."""
    import jax.numpy as jnp
    st0 = tx.init(params)

    def fill(st, name, lr, sl):
        hp = dict(st.hyperparams, learning_rate=jnp.float32(lr), weight_decay=jnp.float32(c["wd"]))
        adam = st.inner_state[0]
        mu, nu = dict(adam.mu), dict(adam.nu)
        mu[name], nu[name] = jnp.asarray(c["m"][..., sl]), jnp.asarray(c["v"][..., sl])
        adam = adam._replace(count=jnp.int32(c["step"]), mu=mu, nu=nu)
        return st._replace(hyperparams=hp, inner_state=(adam,) + tuple(st.inner_state[1:]))

    n = c["p"].size
    if not groups:
        return fill(st0, "w", rates[0], slice(0, n))
    inner = dict(st0.inner_states)
    for (name, sl), lr in zip((("a", slice(0, n // 2)), ("b", slice(n // 2, n))), rates):
        inner[name] = inner[name]._replace(inner_state=fill(inner[name].inner_state, name, lr, sl))
    return st0._replace(inner_states=inner)


def _optax_moments(st, groups):
    import numpy as np
    if not groups:
        a = st.inner_state[0]
        return np.asarray(a.mu["w"]), np.asarray(a.nu["w"])
    ms, vs = [], []
    for name in ("a", "b"):
        a = st.inner_states[name].inner_state.inner_state[0]
        ms.append(np.asarray(a.mu[name]))
        vs.append(np.asarray(a.nu[name]))
    return np.concatenate(ms), np.concatenate(vs)


def optax_case(c, tmp):
    import jax
    import jax.numpy as jnp
    import jaxguard as jg
    groups = c.get("mode") == "groups"
    tx, step = _optax_tx(c, groups)
    n = c["p"].size
    params = ({"a": jnp.asarray(c["p"][:n // 2]), "b": jnp.asarray(c["p"][n // 2:])} if groups
              else {"w": jnp.asarray(c["p"])})
    rates0 = case_rates(c)[0] if not c.get("mode") == "interval" else (c["lr"], c["lr"])
    st = _optax_state(tx, c, params, rates0, groups)
    path = os.path.join(tmp, "o.jg")
    if groups:     # the rates are read from the transformation
        s = jg.save(path, st, params, tx=tx, betas=c["betas"], eps=c["eps"], tau=c["tau"], clip=c["clip"],
                    codec=c["codec"])
    else:
        lr = (c["lr_lo"], c["lr"]) if c.get("mode") == "interval" else c["lr"]
        s = jg.save(path, st, params, lr=lr, betas=c["betas"], eps=c["eps"], weight_decay=c["wd"], tau=c["tau"],
                    clip=c["clip"], codec=c["codec"])
    r = jg.load(path, like=st)
    mt, vt = _optax_moments(r, groups)
    g = grid(c["clip"])
    rng = np.random.default_rng(0)
    G = np.concatenate([np.repeat(g[:, None], n, 1), rng.uniform(-c["clip"], c["clip"], (1, n)).astype(np.float32)])
    rows = G.shape[0]
    bcast = lambda t: jax.tree_util.tree_map(  # noqa: E731
        lambda x: jnp.broadcast_to(x, (rows,) + x.shape) if x.ndim == 1 else x, t)
    split = (lambda x: {"a": x[:, :n // 2], "b": x[:, n // 2:]}) if groups else (lambda x: {"w": x})  # noqa: E731
    join = (lambda d: np.concatenate([np.asarray(d["a"]), np.asarray(d["b"])], 1)) if groups else \
        (lambda d: np.asarray(d["w"]))  # noqa: E731
    P = split(jnp.broadcast_to(jnp.asarray(c["p"]), (rows, n)))
    worst = np.zeros(n)
    for rates in case_rates(c):
        a_st, b_st = (_optax_state(tx, {**c, "m": m, "v": v}, params, rates, groups)
                      for m, v in ((c["m"], c["v"]), (mt, vt)))
        a = join(step(bcast(a_st), P, split(jnp.asarray(G)))).astype(np.float64)
        b = join(step(bcast(b_st), P, split(jnp.asarray(G)))).astype(np.float64)
        lr_of = np.concatenate([np.full(n // 2, rates[0]), np.full(n - n // 2, rates[1])]) if groups else \
            np.full(n, rates[0])
        worst = np.maximum(worst, gaps(a, b, np.float32(lr_of).astype(np.float64)).max(0))
    return s, worst, mt, vt


# ---------------------------------------------------------------- driver
def main():
    global CODECS
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="path prefix: writes PREFIX.json and PREFIX.md (default: "
                    "bench/results/adversarial, or adversarial_CODEC with --codecs, CODEC its first)")
    ap.add_argument("--note", default="", help="what else ran on the machine (written into the results)")
    ap.add_argument("--codecs", default=",".join(CODECS), help="the codecs drawn from (comma-separated; e.g. "
                    "logrel-ans,logrel-aw for the entropy-coded ones)")
    args = ap.parse_args()
    if args.out is None:
        name = "adversarial" if args.codecs == ",".join(CODECS) else "adversarial_" + args.codecs.split(",")[0]
        args.out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", name)
    CODECS = tuple(args.codecs.split(","))
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from jaxguard.errors import JaxguardError
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    stats = {fw: {"cases": 0, "coordinates": 0, "coded": 0, "escapes": 0, "config_errors": 0, "crashes": 0,
                  "violations": 0, "cases_with_violation": 0, "worst_gap_over_tau": 0.0, "by_block": {},
                  "by_mode": {}}
             for fw in ("torch", "optax")}
    errors, crashes, examples = [], [], []
    i = 0
    with tempfile.TemporaryDirectory() as tmp:
        while time.perf_counter() - t0 < 60 * args.minutes:
            fw = "torch" if i % 2 == 0 else "optax"
            i += 1
            c = draw_case(rng, fw)
            S = stats[fw]
            try:
                s, gap, mt, vt = (torch_case if fw == "torch" else optax_case)(c, tmp)
            except JaxguardError as e:
                S["config_errors"] += 1
                if len(errors) < 10 and f"{fw}: {e}" not in errors:
                    errors.append(f"{fw}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - anything else is a bug of the library: record it
                S["crashes"] += 1
                if len(crashes) < 10 and f"{fw}: {type(e).__name__}: {e}" not in crashes:
                    crashes.append(f"{fw}: {type(e).__name__}: {e}")
                continue
            exact = (c["m"].view(np.uint32) == mt.view(np.uint32)) & (c["v"].view(np.uint32) == vt.view(np.uint32))
            over = gap / c["tau"]
            bad = over > 1
            S["cases"] += 1
            bm = S["by_mode"].setdefault(c.get("mode", "targeted"), {"cases": 0, "coded": 0, "violations": 0})
            bm["cases"] += 1
            bm["coded"] += int((~exact).sum())
            bm["violations"] += int(bad.sum())
            S["coordinates"] += c["m"].size
            S["coded"] += int((~exact).sum())
            S["escapes"] += int(s["escapes"])
            S["violations"] += int(bad.sum())
            S["cases_with_violation"] += int(bad.any())
            fin = over[np.isfinite(over)]
            S["worst_gap_over_tau"] = max(S["worst_gap_over_tau"], float(fin.max()) if fin.size else 0.0,
                                          math.inf if (~np.isfinite(over)).any() else 0.0)
            for b, kind in enumerate(c["blocks"]):
                kb = S["by_block"].setdefault(kind, {"blocks": 0, "coded": 0, "violations": 0})
                sl = slice(256 * b, 256 * (b + 1))
                kb["blocks"] += 1
                kb["coded"] += int((~exact[sl]).sum())
                kb["violations"] += int(bad[sl].sum())
            if bad.any() and len(examples) < 20:
                j = int(np.flatnonzero(bad)[np.argmax(over[bad])])
                examples.append({k: c.get(k) for k in ("framework", "lr", "wd", "betas", "eps", "step", "tau", "clip",
                                                       "codec", "decoupled", "mode", "lr_b", "lr_lo")} |
                                {"m": float(c["m"][j]), "v": float(c["v"][j]), "p": float(c["p"][j]),
                                 "mt": float(mt[j]), "vt": float(vt[j]), "gap_over_tau": float(over[j])})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "jaxguard", "torch_compat"], capture_output=True,
                                text=True).stdout)
    import torch
    import jax
    import optax
    rep = {"seconds": round(time.perf_counter() - t0, 1), "seed": args.seed, "codecs": list(CODECS), "commit": commit,
           "dirty": dirty,
           "machine": f"{platform.machine()} {platform.processor()}, {os.cpu_count()} cores"
                      + (f"; {args.note}" if args.note else ""),
           "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "jax": jax.__version__,
                        "optax": optax.__version__},
           "stats": stats, "config_error_examples": errors, "crash_examples": crashes,
           "violation_examples": examples}
    with open(args.out + ".json", "w") as f:
        json.dump(rep, f, indent=1)
    lines = [f"# Adversarial search (bench/fuzz/adversarial.py, seed {args.seed}, {rep['seconds']} s)", "",
             f"Commit {commit}{' (dirty)' if dirty else ''}; {rep['machine']}; torch {torch.__version__}, "
             f"jax {jax.__version__}, optax {optax.__version__}. Codecs drawn from: {', '.join(CODECS)}.", "",
             "| framework | cases | coordinates | coded (not exact) | escapes | config errors | crashes | violations | "
             "cases with a violation | worst gap / tau |", "|---|---|---|---|---|---|---|---|---|---|"]
    for fw, S in stats.items():
        lines.append(f"| {fw} | {S['cases']} | {S['coordinates']:,} | {S['coded']:,} | {S['escapes']:,} | "
                     f"{S['config_errors']} | {S['crashes']} | {S['violations']} | {S['cases_with_violation']} | "
                     f"{S['worst_gap_over_tau']:.6g} |")
    lines += ["", "Cases by mode (point: one rate; groups: two parameters in two groups at rates 1e-3..1e3 apart, "
              "optax saved with tx=; interval: lr=(lr/r, lr), r in 10, 100, 1000, replayed at lo, hi and between):",
              ""]
    for fw, S in stats.items():
        lines.append(f"- {fw}: " + ", ".join(f"{k} {v['cases']} cases / {v['coded']:,} coded / {v['violations']} "
                                             "violations" for k, v in sorted(S["by_mode"].items())))
    lines += ["", "Blocks by kind (coded coordinates, violations):", ""]
    for fw, S in stats.items():
        lines.append(f"- {fw}: " + ", ".join(f"{k} {v['blocks']} blocks / {v['coded']:,} coded / {v['violations']} "
                                             "violations" for k, v in sorted(S["by_block"].items())))
    if errors:
        lines += ["", "Config errors (first few):", ""] + [f"- {e}" for e in errors]
    if crashes:
        lines += ["", "Crashes (not a one-line jaxguard error; first few):", ""] + [f"- {e}" for e in crashes]
    if examples:
        lines += ["", "Violations (first few):", ""] + [f"- {json.dumps(e)}" for e in examples]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(S["violations"] or S["crashes"] for S in stats.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
