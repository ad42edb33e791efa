"""One settings object: every save entry point takes ``spec=`` (a `GuardSpec`) and the
tau/clip/codec/bound/partition keywords override its fields (on the torch side tau/clip/codec
only: the ablation switches bound/partition are set on the spec); every default is defined
once (jaxguard.format.spec) and GuardSpec, GuardConfig and the CLI take it from there."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxguard as jg
from jaxguard.core.config import GuardConfig, GuardSpec, save_spec
from jaxguard.format import container, spec as fspec


def test_defaults_are_defined_once():
    g, c = GuardSpec(), GuardConfig(lr=1e-3, step=0)
    for field, want in (("tau", fspec.DEFAULT_TAU), ("clip", fspec.DEFAULT_CLIP), ("codec", fspec.DEFAULT_CODEC),
                        ("bound", fspec.DEFAULT_BOUND), ("partition", fspec.DEFAULT_PARTITION)):
        assert getattr(g, field) == getattr(c, field) == want, field
    assert jg.DEFAULT_CODEC == fspec.DEFAULT_CODEC


def test_keywords_override_the_spec_and_bad_settings_are_one_line():
    base = GuardSpec(tau=0.005, codec="log8", partition="linear")
    s = save_spec(base, tau=0.02)
    assert (s.tau, s.codec, s.partition, s.clip) == (0.02, "log8", "linear", fspec.DEFAULT_CLIP)
    assert save_spec() == GuardSpec()
    for bad, match in (({"spec": {"tau": 0.01}}, "pass jaxguard.GuardSpec"), ({"codec": "log9"}, "codec='log9'"),
                       ({"tau": -1.0}, "tau=-1.0"), ({"bound": "both"}, "bound='both'")):
        with pytest.raises(jg.ConfigError, match=match) as info:
            save_spec(**bad)
        assert "\n" not in str(info.value)


def _header(path):
    header, _, _ = container.read(str(path), verify_decoded=False)
    return header, [e["config"] for e in header["entries"] if e["kind"] == "moments"]


def test_optax_save_takes_the_spec(tmp_path):
    params = {"w": jnp.linspace(-1, 1, 600, dtype=jnp.float32)}
    tx = optax.adam(1e-3)
    st = tx.init(params)
    _, st = tx.update({"w": jnp.sin(params["w"]) * 0.1}, st, params)
    spec = GuardSpec(tau=0.004, clip=0.3, codec="log8", bound="shared", partition="linear")
    jg.save(tmp_path / "a.jg", st, params, lr=1e-3, spec=spec)
    jg.save(tmp_path / "b.jg", st, params, lr=1e-3, spec=GuardSpec(partition="linear"), tau=0.004, clip=0.3,
            codec="log8")
    (ha, ca), (hb, cb) = _header(tmp_path / "a.jg"), _header(tmp_path / "b.jg")
    assert ca == cb and ca[0]["partition"] == "linear" and ca[0]["tau"] == 0.004 and ha["codec"] == "log8"
    assert ha["payload_sha256"] == hb["payload_sha256"]
    jg.save(tmp_path / "c.jg", st, params, lr=1e-3, spec=spec, tau=0.01)   # the keyword wins
    assert _header(tmp_path / "c.jg")[1][0]["tau"] == 0.01
    for ablation in ({"bound": "separate"}, {"partition": "linear"}):   # the ablation switches: GuardSpec fields only
        with pytest.raises(TypeError, match=next(iter(ablation))):
            jg.save(tmp_path / "d.jg", st, params, lr=1e-3, **ablation)


def test_torch_save_takes_the_spec(tmp_path):
    torch = pytest.importorskip("torch", reason="torch_compat needs torch")
    import torch_compat
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 20)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    model(torch.randn(8, 30)).pow(2).mean().backward()
    opt.step()
    spec = GuardSpec(tau=0.003, partition="linear")
    torch_compat.save(tmp_path / "t.jg", opt, spec=spec)
    h, cfgs = _header(tmp_path / "t.jg")
    assert {c["tau"] for c in cfgs} == {0.003} and {c["partition"] for c in cfgs} == {"linear"} and h["tau"] == 0.003
    torch_compat.save(tmp_path / "u.jg", opt, spec=dataclasses.replace(spec, tau=0.01), tau=0.003)
    assert _header(tmp_path / "u.jg")[0]["payload_sha256"] == h["payload_sha256"]
    assert np.isfinite(h["clip"])


def test_torch_ablation_switches_are_set_on_the_spec_only(tmp_path):
    """The torch side's save entry points take ``bound``/``partition`` through the spec
    alone: the keywords are refused (the planner, whose extra keywords go to DCP's own
    planner, says where they went), the spec's fields reach every entry."""
    torch = pytest.importorskip("torch")
    import inspect

    import torch_compat
    from torch_compat import dcp
    from torch_compat.state import save_snapshot
    for fn in (torch_compat.save, save_snapshot, torch_compat.compress_checkpoint, dcp.compress_dir,
               dcp.GuardedSavePlanner.__init__):
        params = inspect.signature(fn).parameters
        assert "spec" in params and not {"bound", "partition"} & set(params), fn
    with pytest.raises(jg.ConfigError, match=r"GuardedSavePlanner takes partition on the spec: "
                                              r"spec=jaxguard.GuardSpec\(partition='linear'\)"):
        dcp.GuardedSavePlanner(partition="linear")
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    model(torch.randn(3, 6)).pow(2).mean().backward()
    opt.step()
    with pytest.raises(TypeError, match="bound"):
        torch_compat.save(tmp_path / "x.jg", opt, bound="separate")
    torch_compat.save(tmp_path / "s.jg", opt, spec=GuardSpec(bound="separate", partition="linear"))
    _, cfgs = _header(tmp_path / "s.jg")
    assert {(c["bound"], c["partition"]) for c in cfgs} == {("separate", "linear")}
