"""The public surface: one default codec defined once, `dir(jaxguard)` lists the API, the
packages ship `py.typed` and the public save/load carry type hints."""
import ast
import inspect
import pathlib

import pytest

import jaxguard
from jaxguard.format import spec

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sources():
    for pkg in ("jaxguard", "torch_compat"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_default_codec_is_defined_once():
    literal = [str(p.relative_to(ROOT)) for p in _sources() for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
               and any(isinstance(t, ast.Name) and t.id == "DEFAULT_CODEC" for t in node.targets)]
    assert literal == ["jaxguard/format/spec.py"], literal
    from jaxguard.core import config, guard
    assert jaxguard.DEFAULT_CODEC == config.DEFAULT_CODEC == guard.DEFAULT_CODEC == spec.DEFAULT_CODEC


def test_every_verb_defaults_to_the_default_codec():
    from jaxguard.cli.main import build_parser
    p = build_parser()
    for argv in (["compress", "c.pt", "-o", "c.jg"], ["migrate", "c.pt", "--to", "optax", "-o", "c.jg"]):
        assert p.parse_args(argv).codec == spec.DEFAULT_CODEC, argv


def test_dir_lists_the_lazy_api_and_type_checkers_see_it():
    names = set(dir(jaxguard))
    assert set(jaxguard.__all__) <= names and {"save", "load", "GuardConfig", "JaxguardError"} <= names
    tree = ast.parse((ROOT / "jaxguard" / "__init__.py").read_text())
    typed = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.If)
             for imp in node.body if isinstance(imp, ast.ImportFrom) for a in imp.names}
    assert typed == set(jaxguard.__all__) - {"__version__"}, typed ^ (set(jaxguard.__all__) - {"__version__"})


def test_packages_ship_py_typed():
    for pkg in ("jaxguard", "torch_compat"):
        assert (ROOT / pkg / "py.typed").is_file()
    assert 'jaxguard = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def test_torch_save_and_load_are_typed():
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    import torch_compat
    for fn in (torch_compat.save, torch_compat.load):
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, fn
        assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values()), (fn, sig)


def test_inspect_takes_settings_the_header_lacks_from_the_entries(capsys):
    import json
    from jaxguard.cli.main import main
    golden = ROOT / "tests" / "golden" / "containers" / "torch-adam.jaxguard"   # header without op_model/bound
    assert main(["inspect", str(golden), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["op_model"], info["bound"], info["partition"]) == ("torch-adam", "shared", "mixed"), info
    assert main(["inspect", str(golden.with_name("log8.jaxguard"))]) == 0   # entries without configs either
    out = capsys.readouterr().out
    assert "op_model: not recorded" in out and "None" not in out, out


def test_one_encode_v_only():
    """`jaxguard.encode_v_only` is the core's (v coded at the config's tau); the writer's
    encoder of a bfloat16-m job (tau / BF16_TAU_FACTOR, log8-rel's codes for host-chosen
    widths) has a name of its own, so one public name has one meaning."""
    from jaxguard.core import guard
    defined = sorted(str(p.relative_to(ROOT)) for p in _sources() for node in ast.parse(p.read_text()).body
                     if isinstance(node, ast.FunctionDef) and node.name == "encode_v_only")
    assert defined == ["jaxguard/core/guard.py"], defined
    assert jaxguard.encode_v_only is guard.encode_v_only


def test_one_guarded_encode_entry():
    """`jaxguard.core.guard.encode` is the one guarded encode: the writer's record stream is
    `writer.container_entries`, training quantization `quant.quantize` (its old name
    `encode` a deprecated alias); v-only is the entry's ``mu="exact"`` mode, bit for bit
    `encode_v_only`."""
    import numpy as np
    from jaxguard.core import guard
    from jaxguard.errors import ConfigError
    defined = {str(p.relative_to(ROOT)) for p in _sources() for node in ast.parse(p.read_text()).body
               if isinstance(node, ast.FunctionDef) and node.name == "encode"}
    # quant/codecs.py's `encode` is the deprecated alias of `quantize` (a public import path)
    assert "jaxguard/core/guard.py" in defined and defined <= {"jaxguard/core/guard.py", "jaxguard/quant/codecs.py"}, defined
    assert jaxguard.encode is guard.encode
    rng = np.random.default_rng(0)
    m = (rng.standard_normal(700) * 1e-3).astype(np.float32)
    v = (m.astype(np.float64) ** 2 * 4 + 1e-8).astype(np.float32)
    p = rng.standard_normal(700).astype(np.float32)
    cfg = jaxguard.GuardConfig(lr=1e-3, step=10)
    mode, sibling = guard.encode(m, v, p, cfg, mu="exact"), guard.encode_v_only(m, v, p, cfg)
    assert mode.stats["coordinates"] == 700 and set(mode.arrays) == set(sibling.arrays)
    assert all(np.array_equal(np.asarray(mode.arrays[k]), np.asarray(sibling.arrays[k])) for k in mode.arrays)
    with pytest.raises(ConfigError, match="mu='raw'"):
        guard.encode(m, v, p, cfg, mu="raw")
