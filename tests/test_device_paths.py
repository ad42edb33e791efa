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
