"""One tiling rule for every directory checkpoint: `jaxguard.format.manifest.check_tiling`.

The sharded manifest and DCP's ``.metadata`` (its tensor chunks, and the guarded shards of
jaxguard's manifest in it) describe a leaf by tiles; the same corruption of either gives the
same `CheckpointError` line (issue 59: they raised a ContainerError and two other wordings).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxguard as jg
CORPUS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fuzz_corpus")


@pytest.mark.parametrize("tiles, match", [
    ([("a", [0, 0], [2, 3]), ("b", [2, 0], [2, 3])], None),
    ([("a", [0, 0], [2, 3]), ("b", [3, 0], [2, 3])], "lies outside 'w'"),
    ([("a", [0, 0], [2, 3]), ("b", [2, 0], [2])], "lies outside 'w'"),
    ([("a", [0, 0], [2, 3]), ("b", [2, -1], [2, 3])], "lies outside 'w'"),
    ([("a", [0, 0], [2, 3]), ("b", [2, True], [2, 3])], "lies outside 'w'"),
    ([("a", [0, 0], [2, 3])], "hold 6 of its 12 elements"),
    ([("a", [0, 0], [4, 3]), ("b", [0, 0], [4, 3])], "hold 24 of its 12 elements"),
    ([], "hold 0 of its 12 elements"),
    ([("a", [0, 0], [3, 3]), ("b", [2, 0], [1, 3])], "'a' and 'b' of 'w' overlap"),       # row 3 in none
    ([("b", [0, 1], [4, 1]), ("a", [0, 0], [4, 2])], "'a' and 'b' of 'w' overlap"),       # column 2 in none
    ([("c", [2, 2], [2, 1]), ("a", [0, 0], [4, 2]), ("b", [0, 2], [2, 1])], None),
])
def test_check_tiling(tiles, match):
    from jaxguard.format.manifest import check_tiling
    if match is None:
        check_tiling("src", "w", [4, 3], tiles)
        return
    with pytest.raises(jg.CheckpointError, match=match) as e:
        check_tiling("src", "w", [4, 3], tiles)
    assert str(e.value).startswith("src: ") and "\n" not in str(e.value)


def test_an_overlapping_shard_is_refused_before_load(tmp_path):
    """Two shards placed on the same rows hold the leaf's size between them: the load used to
    assemble the leaf from them and return the rows no shard wrote uninitialised."""
    d = str(tmp_path / "sharded")
    shutil.copytree(os.path.join(CORPUS, "sharded_manifest", "seed"), d)
    mpath = os.path.join(d, "manifest.json")
    man = json.load(open(mpath))
    first, second = man["shards"]["state/moments/0.mu.w"]
    second["start"] = first["start"]
    json.dump(man, open(mpath, "w"))
    with pytest.raises(jg.CheckpointError, match=f"{first['name']!r} and {second['name']!r} of '0.mu.w' overlap"):
        jg.load(d, _seed_like())


def test_empty_leaf_needs_one_tile():
    from jaxguard.format.manifest import check_tiling
    check_tiling("src", "e", [0, 3], [("a", [0, 0], [0, 3])])
    with pytest.raises(jg.CheckpointError, match="hold 0 of its 0 elements"):
        check_tiling("src", "e", [0, 3], [])


def _seed_like():
    params = {"w": jnp.zeros((8, 16), jnp.float32), "b": jnp.zeros(16)}
    return jax.tree_util.tree_map(np.asarray, optax.adamw(1e-3, weight_decay=1e-2).init(params))


def _sharded_outside(tmp_path):
    d = str(tmp_path / "sharded")
    shutil.copytree(os.path.join(CORPUS, "sharded_manifest", "seed"), d)
    mpath = os.path.join(d, "manifest.json")
    man = json.load(open(mpath))
    leaf = next(leaf for leaf in man["state"]["leaves"] if len(leaf["shape"]) == 2)
    man["shards"][leaf["entry"]][0]["start"] = [leaf["shape"][0], 0]   # the shard moved past the end of its leaf
    json.dump(man, open(mpath, "w"))
    with pytest.raises(jg.JaxguardError) as e:
        jg.load(d, _seed_like())
    return e.value


def _dcp_outside(tmp_path, which):
    pytest.importorskip("torch", reason="needs torch")
    from torch_compat import dcp as tdcp
    from torch_compat.dcp_metadata import load_metadata
    d = str(tmp_path / "dcp")
    shutil.copytree(os.path.join(CORPUS, "dcp_manifest", "seed"), d)
    md = load_metadata(d)
    if which == "chunk":            # a tensor chunk of the DCP metadata moved past the end of its tensor
        m = next(m for m in md.state_dict_metadata.values() if len(getattr(m, "size", ())) == 2)
        c = m.chunks[0]
        c.offsets = type(c.offsets)([m.size[0], 0])
    else:                           # a guarded shard of jaxguard's manifest moved past the end of its moment
        e = next(e for e in md.planner_data["__jaxguard__"]["moments"].values() if len(e["shape"]) == 2)
        e["shards"][0]["offsets"] = [e["shape"][0], 0]
    with open(os.path.join(d, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)
    with pytest.raises(jg.JaxguardError) as e:
        tdcp.verify_dir(d)
    return e.value


@pytest.mark.parametrize("which", ["chunk", "guarded shard"])
def test_one_error_for_a_shard_outside_its_leaf(tmp_path, which):
    """The same corruption (a tile past the end of its leaf) in a sharded manifest and in a
    DCP checkpoint: one error type, one wording."""
    errors = [_sharded_outside(tmp_path), _dcp_outside(tmp_path, which)]
    assert [type(e) for e in errors] == [jg.CheckpointError] * 2, [repr(e) for e in errors]
    for e in errors:
        assert " lies outside " in str(e) and str(e).endswith("; the checkpoint's metadata is corrupt"), str(e)


@pytest.mark.parametrize("sites", [1.5, [{"path": ["0"], "config": {"op_model": "optax-adam"}}],
                                   [{"path": "0", "config": {"op_model": ["optax-adam"]}}], ["0"]])
def test_malformed_sites_are_one_line(tmp_path, sites):
    """bench/fuzz/fuzz_manifest.py found these: the load's platform check read the sites'
    records unchecked (TypeError: 'float' object is not iterable, unhashable type: 'list')."""
    d = str(tmp_path / "sharded")
    shutil.copytree(os.path.join(CORPUS, "sharded_manifest", "seed"), d)
    mpath = os.path.join(d, "manifest.json")
    man = json.load(open(mpath))
    man["state"]["sites"] = sites
    json.dump(man, open(mpath, "w"))
    with pytest.raises(jg.ContainerError, match="'state' has 'sites' that are not records") as e:
        jg.load(d, _seed_like())
    assert "\n" not in str(e.value)
