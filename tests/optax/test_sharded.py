"""Sharded checkpoint layout in one process: same decode as the single file, commit
semantics (no manifest -> not a checkpoint), corruption caught by the manifest's hashes."""
import json
import re
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxguard as jg
from jaxguard import sharded
from optax_states import trained_adamw


@pytest.fixture(scope="module")
def trained():
    return trained_adamw((40, 30), steps=4)


def test_one_shard_per_leaf_decodes_like_the_single_file(tmp_path, trained):
    tx, params, st = trained
    a = jg.save(tmp_path / "one.jg", st, params, lr=1e-3, weight_decay=1e-2)
    b = jg.save(tmp_path / "dir", st, params, lr=1e-3, weight_decay=1e-2, sharded=True)
    assert b["coordinates"] == b["total"]["coordinates"] == a["coordinates"] == 1230
    assert b["escapes"] == a["escapes"]
    names = sorted(os.listdir(tmp_path / "dir"))
    assert names[0] == "manifest.json" and len(names) == 2 and re.fullmatch(r"process_00000\.[0-9a-f]{24}\.jaxguard", names[1])
    assert sharded.verify(tmp_path / "dir")["ok"]
    like = jax.tree_util.tree_map(np.asarray, tx.init(params))
    ra, rb = jg.load(tmp_path / "one.jg", like), jg.load(tmp_path / "dir", like)
    for x, y in zip(jax.tree_util.tree_leaves(ra), jax.tree_util.tree_leaves(rb)):
        assert isinstance(y, np.ndarray) and np.array_equal(x, y)


def test_no_manifest_is_no_checkpoint(tmp_path, trained):
    tx, params, st = trained
    jg.save(tmp_path / "dir", st, params, lr=1e-3, weight_decay=1e-2, sharded=True)
    os.unlink(tmp_path / "dir" / "manifest.json")
    with pytest.raises(jg.CheckpointError, match="did not complete"):
        jg.load(tmp_path / "dir", tx.init(params))


def test_corrupt_shard_is_caught(tmp_path, trained):
    tx, params, st = trained
    jg.save(tmp_path / "dir", st, params, lr=1e-3, weight_decay=1e-2, sharded=True)
    man = json.load(open(tmp_path / "dir" / "manifest.json"))
    rec = man["shards"]["state/moments/0.mu.w"][0]
    f = tmp_path / "dir" / rec["file"]
    data = bytearray(f.read_bytes())
    data[rec["range"][0] + 5] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(jg.ContainerError, match="SHA-256"):
        jg.load(tmp_path / "dir", tx.init(params))
    with pytest.raises(jg.ContainerError):
        sharded.verify(tmp_path / "dir")


def test_cli_verify_and_inspect_a_sharded_directory(tmp_path, trained, capsys):
    from jaxguard.cli.main import main
    tx, params, st = trained
    s = jg.save(tmp_path / "dir", st, params, lr=1e-3, weight_decay=1e-2, sharded=True)
    assert main(["verify", str(tmp_path / "dir")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok {tmp_path / 'dir'} (a jaxguard sharded checkpoint directory): 1 process files and ")
    assert s["save_id"] in out
    assert main(["inspect", "--json", str(tmp_path / "dir")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["framework"] == "optax-sharded" and info["coordinates"] == 1230 and info["save_id"] == s["save_id"]
    f = tmp_path / "dir" / f"process_00000.{s['save_id']}.jaxguard"
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "dir")]) == 1
    assert capsys.readouterr().out.startswith(f"FAILED {tmp_path / 'dir'} (a jaxguard sharded checkpoint directory): ")
    os.unlink(f)
    assert main(["inspect", str(tmp_path / "dir")]) == 2
    err = capsys.readouterr().err
    assert "is missing" in err and len(err.strip().splitlines()) == 1


CORPUS = os.path.join(os.path.dirname(__file__), "..", "fuzz_corpus", "sharded_manifest")


def test_manifest_fuzz_corpus_replays(tmp_path):
    """bench/fuzz/fuzz_manifest.py's findings (all fixed) and refusals: each manifest loads or is
    refused with one JaxguardError line, never another exception."""
    seed = os.path.join(CORPUS, "seed")
    cases = sorted(os.listdir(os.path.join(CORPUS, "cases")))
    assert any(c.startswith("finding-") for c in cases) and len(cases) > 20
    d = str(tmp_path / "dir")
    import shutil
    shutil.copytree(seed, d)
    params = {"w": jnp.zeros((8, 16), jnp.float32), "b": jnp.zeros(16)}
    like = jax.tree_util.tree_map(np.asarray, optax.adamw(1e-3, weight_decay=1e-2).init(params))
    jg.load(d, like)   # the seed itself loads
    refused = 0
    for c in cases:
        shutil.copy(os.path.join(CORPUS, "cases", c), os.path.join(d, "manifest.json"))
        try:
            jg.load(d, like)
            sharded.verify(d)
        except jg.JaxguardError as exc:
            assert "\n" not in str(exc), (c, str(exc))
            refused += 1
    assert refused >= len(cases) - 5


def test_sharded_save_and_load_need_no_etils(tmp_path):
    """`pip install .` has no etils: sharded save/load and the jitted hook's writer must not import it."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['etils'] = None; sys.modules['etils.epath'] = None\n"
            "import jax.numpy as jnp, optax, jaxguard as jg\nfrom jaxguard import jit_state, sharded\n"
            "p = {'w': jnp.ones((4, 8))}; tx = optax.adam(1e-3); st = tx.init(p)\n"
            "_, st = tx.update({'w': jnp.full((4, 8), 0.1)}, st, p)\n"
            f"jg.save({str(tmp_path / 'ck')!r}, st, p, lr=1e-3, sharded=True)\n"
            f"jg.load({str(tmp_path / 'ck')!r}, tx.init(p)); print('loaded')\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.strip() == "loaded", r.stderr[-1500:]
