"""Where state lives and where it resumes: the op model chosen for optax state by its
arrays' platform (or named), the warning on a restore onto another kernel than the
certified one (optax and torch), and torch tensors handed to the encoder through DLPack
or host slabs.  No test needs a GPU: the CUDA-only branches are the ones these cannot
reach (docs/gpu.md)."""
import json
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxguard as jg
from jaxguard.core.opmodel import OPTAX_OP_MODELS, resolve_optax_op_model
from jaxguard.errors import ConfigError, JaxguardWarning
from jaxguard.format import container
from jaxguard.optax_state import platforms_of


def _torch():
    return pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")


def _optax_state(tx, n=600, seed=0):
    rng = np.random.default_rng(seed)
    params = {"a": jnp.asarray(rng.normal(size=(n,)).astype(np.float32)),
              "b": jnp.asarray(rng.normal(size=(3, 40)).astype(np.float32))}
    st = tx.init(params)
    for _ in range(3):
        g = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape).astype(np.float32)) * 1e-2, params)
        u, st = tx.update(g, st, params)
        params = optax.apply_updates(params, u)
    return params, st


def _entry_models(path):
    header, _, _ = container.read(str(path), verify_decoded=False)
    return header.get("op_model"), {(e.get("config") or {}).get("op_model") for e in header["entries"]
                                    if e.get("config")}


def _no_warning(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxguardWarning)
        return fn(*a, **k)


def _one_warning(fn, *a, **k):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn(*a, **k)
    ours = [w for w in rec if issubclass(w.category, JaxguardWarning)]
    assert len(ours) == 1, [str(w.message) for w in rec]
    msg = str(ours[0].message)
    assert "\n" not in msg
    return out, msg


# ---------------------------------------------------------------- choosing the optax model
@pytest.mark.parametrize("platforms,decoupled,want", [
    ((), False, "optax-adam"), (("cpu",), False, "optax-adam"), (("cpu",), True, "optax-adamw"),
    (("gpu",), False, "optax-adam-gpu"), (("cuda",), True, "optax-adamw-gpu"), (("rocm",), False, "optax-adam-gpu"),
    (("gpu", "cuda"), False, "optax-adam-gpu"), (("tpu",), False, "optax-adam"),
])
def test_optax_model_follows_the_platform(platforms, decoupled, want):
    assert resolve_optax_op_model(decoupled=decoupled, platforms=platforms) == want


@pytest.mark.parametrize("kw,message", [
    (dict(decoupled=False, op_model="torch-adam-cuda-foreach"), "is not an optax op model"),
    (dict(decoupled=False, op_model="optax-adamw-gpu"), "name optax-adam-gpu"),
    (dict(decoupled=True, op_model="optax-adam"), "name optax-adamw or pass"),
    (dict(decoupled=False, op_model="bogus"), "use one of optax-adam, optax-adamw, optax-adam-gpu"),
    (dict(decoupled=False, platforms=("cpu", "gpu")), "name the one the run resumes on"),
])
def test_optax_model_refusals_are_one_line(kw, message):
    with pytest.raises(ConfigError) as exc:
        resolve_optax_op_model(**kw)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_named_optax_model_wins_over_the_platform():
    for name in OPTAX_OP_MODELS:
        got = resolve_optax_op_model(decoupled="adamw" in name, platforms=("gpu",), op_model=name)
        assert got == name


def test_platforms_of_counts_device_arrays_only():
    x = jnp.ones(4)
    assert platforms_of({"a": x, "b": np.ones(3), "c": 1.0}) == {"cpu"}
    assert platforms_of({"b": np.ones(3)}) == set()
    sds = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=x.sharding)
    assert platforms_of([sds]) == {"cpu"}


# ---------------------------------------------------------------- optax saves and the restore warning
def test_optax_save_records_the_named_gpu_model_and_load_on_cpu_warns(tmp_path):
    tx = optax.adam(1e-3)
    params, st = _optax_state(tx)
    jg.save(tmp_path / "gpu.jg", st, params, lr=1e-3, op_model="optax-adam-gpu")
    assert _entry_models(tmp_path / "gpu.jg") == ("optax-adam-gpu", {"optax-adam-gpu"})
    restored, msg = _one_warning(jg.load, tmp_path / "gpu.jg", tx.init(params))
    assert "optax-adam-gpu" in msg and "onto cpu" in msg and "op_model='optax-adam'" in msg
    # the warning changes nothing restored: the same state as a CPU-certified load of these codes
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(st)
    out = subprocess.run([sys.executable, "-m", "jaxguard", "inspect", str(tmp_path / "gpu.jg"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["op_model"] == "optax-adam-gpu"


def test_optax_default_is_the_cpu_model_and_loads_without_warning(tmp_path):
    tx = optax.adamw(1e-3, weight_decay=0.01)
    params, st = _optax_state(tx, seed=1)
    jg.save(tmp_path / "cpu.jg", st, params, lr=1e-3, weight_decay=0.01)
    assert _entry_models(tmp_path / "cpu.jg") == ("optax-adamw", {"optax-adamw"})
    _no_warning(jg.load, tmp_path / "cpu.jg", tx.init(params))
    jg.save(tmp_path / "w.jg", st, params, lr=1e-3, weight_decay=0.01, op_model="optax-adamw-gpu")
    assert _entry_models(tmp_path / "w.jg")[0] == "optax-adamw-gpu"


def test_optax_save_refuses_a_foreign_model_and_writes_nothing(tmp_path):
    tx = optax.adam(1e-3)
    params, st = _optax_state(tx, n=64)
    for bad in ("torch-adam", "optax-adamw-gpu"):
        with pytest.raises(ConfigError) as exc:
            jg.save(tmp_path / "bad.jg", st, params, lr=1e-3, op_model=bad)
        assert bad in str(exc.value) and "\n" not in str(exc.value)
        assert not (tmp_path / "bad.jg").exists()


def test_sharded_and_orbax_saves_take_op_model(tmp_path):
    from jaxguard import sharded
    from jaxguard.checkpoint import GuardedCheckpointHandler, GuardedSave
    tx = optax.adam(1e-3)
    params, st = _optax_state(tx, n=300, seed=2)
    jg.save(tmp_path / "dir", st, params, lr=1e-3, sharded=True, op_model="optax-adam-gpu")
    assert sharded.read_manifest(str(tmp_path / "dir"))["op_model"] == "optax-adam-gpu"
    _, msg = _one_warning(jg.load, tmp_path / "dir", tx.init(params))
    assert "optax-adam-gpu" in msg
    h = GuardedCheckpointHandler()
    (tmp_path / "item").mkdir()
    h.save(tmp_path / "item", args=GuardedSave(st, params, lr=1e-3, op_model="optax-adam-gpu"))
    assert h.metadata(tmp_path / "item")["op_model"] == "optax-adam-gpu"


# ---------------------------------------------------------------- torch: the restore warning
def _torch_opt(torch, device="cpu", **flags):
    torch.manual_seed(0)
    m = torch.nn.Linear(24, 12)
    opt = torch.optim.Adam(m.named_parameters(), lr=1e-3, **flags)
    m(torch.randn(5, 24)).square().sum().backward()
    opt.step()
    if device != "cpu":
        m2 = torch.nn.Linear(24, 12, device=device)
        return torch.optim.Adam(m2.named_parameters(), lr=1e-3, **flags), opt
    return opt, opt


def test_torch_load_warns_when_the_certified_kernel_is_not_the_one_that_runs(tmp_path):
    torch = _torch()
    from torch_compat import state
    _, opt = _torch_opt(torch)
    state.save(tmp_path / "cuda.jg", opt, op_model="torch-adam-cuda-foreach")
    fresh, _ = _torch_opt(torch)
    _, msg = _one_warning(state.load, tmp_path / "cuda.jg", fresh)
    assert "torch-adam-cuda-foreach" in msg and "resumes on cpu" in msg and "op_model='torch-adam'" in msg
    state.save(tmp_path / "cpu.jg", opt)
    fresh, _ = _torch_opt(torch)
    _no_warning(state.load, tmp_path / "cpu.jg", fresh)
    # a foreach CPU state resumes on the foreach CPU kernel it was certified for: no warning
    _, opt_f = _torch_opt(torch, foreach=True)
    state.save(tmp_path / "foreach.jg", opt_f)
    fresh, _ = _torch_opt(torch, foreach=True)
    _no_warning(state.load, tmp_path / "foreach.jg", fresh)


def test_torch_restore_lands_on_the_parameters_device(tmp_path):
    """Parameters on the meta device (no data, but a device other than the CPU): the
    restored moments follow them, and no op model covers that device, which warns."""
    torch = _torch()
    from torch_compat import state
    target, opt = _torch_opt(torch, device="meta")
    state.save(tmp_path / "a.jg", opt)
    _, msg = _one_warning(state.load, tmp_path / "a.jg", target)
    assert "resumes on meta" in msg and "no op model covers" in msg
    for p in (p for g in target.param_groups for p in g["params"]):
        st = target.state[p]
        assert st["exp_avg"].device == p.device and st["exp_avg_sq"].device == p.device


# ---------------------------------------------------------------- torch: tensors into the encoder
def test_cpu_tensors_reach_jax_through_dlpack_without_a_copy():
    torch = _torch()
    from torch_compat.state import HostTensor, encoder_view, jax_platform_of
    t = torch.randn(1024)
    a = encoder_view(t)
    assert isinstance(a, jax.Array) and a.unsafe_buffer_pointer() == t.data_ptr()
    assert np.asarray(a).view(np.uint32).tolist() == t.numpy().view(np.uint32).tolist()
    for view in (torch.randn(8, 6).t(), torch.randn(1030)[3:]):   # strided; 12 bytes off: read on the host
        h = encoder_view(view)
        assert isinstance(h, HostTensor) and np.array_equal(np.asarray(h), view.contiguous().numpy())
    assert encoder_view(torch.zeros(0)).shape == (0,)
    assert jax_platform_of("cpu") == "cpu" and jax_platform_of("meta") is None
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert jax_platform_of("cuda") is None    # CPU-only JAX: CUDA tensors go through host slabs
    h = encoder_view(t, dlpack=False)
    assert isinstance(h, HostTensor) and h.shape == (1024,) and h.size == 1024 and h.dtype == np.float32
    t[0] = 7.0                                    # read when the writer reads it, not before
    assert np.asarray(h)[0] == 7.0 and np.asarray(h, np.float64).dtype == np.float64


def test_bytes_do_not_depend_on_the_route():
    torch = _torch()
    from jaxguard import writer
    from jaxguard.core.guard import GuardConfig
    from jaxguard.format import reader
    from torch_compat.state import encoder_view
    g = torch.Generator().manual_seed(3)
    m, v, p = (torch.randn(5000, generator=g) * 1e-3, torch.rand(5000, generator=g) * 1e-6,
               torch.randn(5000, generator=g))
    m[:7] = torch.tensor([0.0, -0.0, 1e-40, -1e-38, 3e38, -3e38, 1e-45])
    cfg = GuardConfig(lr=1e-3, step=10)
    outs = []
    for route in (lambda t: t.numpy(), encoder_view, lambda t: encoder_view(t, dlpack=False)):
        rec = [writer.MomentJob("x", route(m), route(v), route(p), cfg, {"param": "x"})]
        header, payload = reader.parse(writer.to_bytes(rec, {"framework": "test"})[0])[:2]
        outs.append((header["payload_sha256"], header["decoded_sha256"], bytes(payload)))
    assert outs[0] == outs[1] == outs[2]    # the header differs only in encode_seconds


def test_jitted_save_hook_takes_op_model_and_load_on_cpu_warns(tmp_path):
    tx = optax.adam(1e-3)
    params, st = _optax_state(tx, seed=2)
    k = jg.state_constants(st, params, lr=1e-3, op_model="optax-adam-gpu")
    enc = jax.jit(lambda s, p, k: jg.encode_state_jit(s, p, k))(st, params, k)
    jg.write(tmp_path / "jit", enc, k)
    man = json.loads((tmp_path / "jit" / "manifest.json").read_text())
    assert man["op_model"] == "optax-adam-gpu"
    _, msg = _one_warning(jg.load, tmp_path / "jit", tx.init(params))
    assert "optax-adam-gpu" in msg and "onto cpu" in msg
    with pytest.raises(ConfigError, match="torch-adam"):
        jg.state_constants(st, params, lr=1e-3, op_model="torch-adam")


# ---------------------------------------------------------------- torch: encoded where the tensors live
def _trained(torch, cls, steps=4, seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7))
    opt = cls(model.named_parameters(), lr=1e-3, **kw)
    for _ in range(steps):
        model(torch.randn(16, 40)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _routes(path):
    header, _, _ = container.read(str(path), verify_decoded=False)
    return {e["name"]: e["stats"].get("route", "host") for e in header["entries"] if e["kind"] == "moments"}


@pytest.mark.parametrize("cls,kw", [("Adam", {}), ("AdamW", {"weight_decay": 0.01}), ("Adam", {"weight_decay": 0.1})])
def test_device_route_writes_what_the_reader_reads_and_audits_within_tau(tmp_path, cls, kw):
    """`device_encode=True` runs the GPU route (the jitted guard on the arrays' device) on
    CPU JAX arrays: the container verifies, the numpy reader agrees with what was
    certified, the real torch update from the restored state is within tau, and the
    restored moments land on the parameters' device."""
    torch = _torch()
    import torch_compat
    from torch_compat import state
    model, opt = _trained(torch, getattr(torch.optim, cls), **kw)
    torch_compat.save(tmp_path / "dev.jg", opt, device_encode=True)
    torch_compat.save(tmp_path / "host.jg", opt, device_encode=False)
    assert set(_routes(tmp_path / "dev.jg").values()) == {"device"}
    assert set(_routes(tmp_path / "host.jg").values()) == {"host"}
    out = subprocess.run([sys.executable, "-m", "jaxguard", "verify", str(tmp_path / "dev.jg")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok "), out.stdout + out.stderr
    restored, _ = state.restore_tree(tmp_path / "dev.jg")
    original = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    got = torch_compat.audit(original, restored, tau=0.01)
    assert got["violations"] == 0 and got["max_gap_lr"] <= 0.01, got
    # the host route certifies the same coordinates here (both certify every candidate they can)
    host, _ = state.restore_tree(tmp_path / "host.jg")
    for idx, st in restored["optimizer"]["state"].items():
        hst = host["optimizer"]["state"][idx]
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k].view(torch.int32), hst[k].view(torch.int32)), (idx, k)
    fresh_model, fresh = _trained(torch, getattr(torch.optim, cls), steps=0, **kw)
    fresh_model.load_state_dict(model.state_dict())
    _no_warning(torch_compat.load, tmp_path / "dev.jg", fresh)
    for p in (p for g in fresh.param_groups for p in g["params"]):
        assert fresh.state[p]["exp_avg"].device == p.device and fresh.state[p]["exp_avg_sq"].dtype == torch.float32


def test_device_route_keeps_escapes_exact_at_the_edges():
    """NaN, +-Inf, subnormals, moments below 2**-80, -0.0 and FLT_MAX-sized values, in
    tensors of odd sizes beside an empty one, a slab of several and a tensor encoded in
    pieces: every coordinate the guard cannot certify comes back bit for bit, as on the
    host route."""
    torch = _torch()
    from jaxguard import writer
    from jaxguard.core.guard import GuardConfig
    from jaxguard.format import reader
    from torch_compat.state import encoder_view
    g = torch.Generator().manual_seed(5)
    jobs, originals = [], {}
    for name, n in (("a", 5000), ("b", 257), ("e", 0), ("c", 3000)):
        m, v, p = (torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6, torch.randn(n, generator=g))
        if n:
            edges = torch.tensor([0.0, -0.0, 1e-40, -1e-38, 3e38, -3.4e38, 1e-45, float("nan"), float("inf"),
                                  float("-inf"), 2.0 ** -81, -(2.0 ** -90)])
            m[:12] = edges
            v[12:24] = edges.abs()
            v[24] = -1e-6                       # a negative v: never certifiable
            p[30:33] = torch.tensor([float("nan"), float("inf"), 1e-42])
        originals[name] = (m, v)
        jobs.append((name, m, v, p))
    cfg = GuardConfig(lr=1e-3, step=3, codec="log8-rel")   # the device route does not widen blocks (log8-rel-zstd)
    outs = {}
    for route in (True, False):
        recs = [writer.MomentJob(nm, encoder_view(m), encoder_view(v), encoder_view(p), cfg, {"param": nm})
                for nm, m, v, p in jobs]
        entries = list(writer.container_entries(recs, slab=2048, device_encode=route))   # "a" is over 2 slabs: in pieces
        assert [e.encoded.stats.get("route", "host") for e in entries] == ["device" if route else "host"] * 4
        data = container.build(entries, {"framework": "test"})
        header, payload = reader.parse(data)[:2]
        outs[route] = {e["name"]: reader.read_moments(e, payload, header.get("tables", {})) for e in header["entries"]}
    for name, (m, v) in originals.items():
        mb, vb = m.numpy().view(np.uint32), v.numpy().view(np.uint32)
        for route in (True, False):
            dm, dv = (np.asarray(x, np.float32).reshape(-1).view(np.uint32) for x in outs[route][name])
            if not m.numel():
                assert dm.size == 0 and dv.size == 0
                continue
            fin = np.isfinite(m.numpy()) & np.isfinite(v.numpy()) & (v.numpy() >= 0)
            tiny = (np.abs(m.numpy()) < 2.0 ** -80) & (m.numpy() != 0) | (np.abs(v.numpy()) < 2.0 ** -80) & (v.numpy() != 0)
            must = ~fin | tiny
            assert must[:25].sum() >= 15
            assert (dm[must] == mb[must]).all() and (dv[must] == vb[must]).all(), (name, route)
        assert all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
                   for a, b in zip(outs[True][name], outs[False][name])), name


def test_device_route_runs_again_when_a_level_or_the_escape_buffers_run_short(monkeypatch):
    """First capacities of one candidate a level and one escape slot: the program reports
    what was pending and escaped, and the second run, with capacities that fit, certifies
    what the host route certifies (nothing left over escapes for lack of room)."""
    torch = _torch()
    from jaxguard.core import device_encode, guard
    from jaxguard.core.guard import GuardConfig
    from torch_compat.state import encoder_view
    _, opt = _trained(torch, torch.optim.Adam, steps=1)    # step 1: many candidates reach the deep levels
    items = []
    for p in (p for g in opt.param_groups for p in g["params"]):
        st = opt.state[p]
        items.append((encoder_view(st["exp_avg"]), encoder_view(st["exp_avg_sq"]), encoder_view(p.detach()),
                      GuardConfig(lr=1e-3, step=1, codec="log8-rel")))   # as the device route proposes
    host = guard.encode_many([(np.asarray(m), np.asarray(v), np.asarray(p), c) for m, v, p, c in items])
    for k, val in (("MIN_CAPACITY", 1), ("LEVEL0_FRACTION", 1 << 30), ("LATER_CAPACITIES", (1, 1, 1, 1)),
                   ("ESCAPE_FRACTION", 1 << 30)):
        monkeypatch.setattr(device_encode, k, val)
    dev = device_encode.encode_many(items, sample_every=container.SAMPLE_EVERY, force=True)
    assert sum(e.stats["escapes"] for e in host) > 100
    for d, h in zip(dev, host):
        assert d.stats["route"] == "device"
        assert np.array_equal(d.arrays["escape_index"], h.arrays["escape_index"])
        assert np.array_equal(d.arrays["m_codes"], h.arrays["m_codes"])


def test_device_route_makes_no_implicit_transfer_of_the_moments():
    """With JAX's transfer guards set to disallow, the device route still writes the
    container (its only transfers are explicit: ``device_put`` of the constants and
    ``device_get`` of codes, escapes and samples), while the host route, which stages
    the moments in numpy buffers and hands them back to its jitted passes, is refused.
    On the CPU, JAX's device-to-host guard does not fire (a CPU array's numpy view is no
    transfer; checked below): what this shows there is that nothing is staged on the
    host and sent back; on a GPU the same test also forbids copying the moments out."""
    torch = _torch()
    from jaxguard import writer
    from jaxguard.core.guard import GuardConfig
    from torch_compat.state import encoder_view
    g = torch.Generator().manual_seed(7)
    m, v, p = (torch.randn(4000, generator=g) * 1e-3, torch.rand(4000, generator=g) * 1e-6, torch.randn(4000, generator=g))
    cfg = GuardConfig(lr=1e-3, step=10)

    def write(route):
        rec = [writer.MomentJob("x", encoder_view(m), encoder_view(v), encoder_view(p), cfg, {"param": "x"})]
        return writer.to_bytes(rec, {"framework": "test"}, device_encode=route)[0]

    want = write(True)
    write(False)                                   # compile both routes before the guard is on
    y = jnp.arange(3.0) * 2
    keys = ("jax_transfer_guard_host_to_device", "jax_transfer_guard_device_to_host")
    before = [getattr(jax.config, k) for k in keys]
    for k in keys:
        jax.config.update(k, "disallow")
    try:
        if jax.devices()[0].platform == "cpu":
            np.asarray(y)                          # the CPU's device-to-host guard lets this through
        got = write(True)
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            write(False)
    finally:
        for k, b in zip(keys, before):
            jax.config.update(k, b)
    from jaxguard.format import reader
    hw, hg = reader.parse(want)[0], reader.parse(got)[0]
    assert hw["payload_sha256"] == hg["payload_sha256"] and hw["decoded_sha256"] == hg["decoded_sha256"]


def test_device_encode_setting_reads_the_environment(monkeypatch):
    from jaxguard import writer
    monkeypatch.delenv("JAXGUARD_DEVICE_ENCODE", raising=False)
    assert writer.device_encode_setting() is None and writer.device_encode_setting(True) is True
    monkeypatch.setenv("JAXGUARD_DEVICE_ENCODE", "1")
    assert writer.device_encode_setting() is True and writer.device_encode_setting(False) is False
    monkeypatch.setenv("JAXGUARD_DEVICE_ENCODE", "gpu")
    with pytest.raises(ConfigError) as exc:
        writer.device_encode_setting()
    assert "JAXGUARD_DEVICE_ENCODE='gpu'" in str(exc.value) and "\n" not in str(exc.value)
