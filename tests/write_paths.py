"""Every write path of jaxguard on one fixed, CPU-independent state (no training: the
moments are drawn with numpy), and the payload / decoded SHA-256 of what each writes
(computed here, so files sealed with BLAKE3 record the same values as the SHA-256 files before).

`python tests/write_paths.py OUT.json` records them (tests/golden/write_paths.json was
recorded with the main before the one write path, commit 4f96cda; the logrel-ans payloads
again when the rANS fit began taking the smallest table within its slack, their decoded
hashes unchanged);
tests/core/test_write_paths.py checks that today's writers produce the same files and that
each refuses certified values the reader does not decode to.
"""
from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np

LR = 1e-3
CODECS = ("log8-rel", "logrel-ans")


def _moments(rng, shape, step):
    """Adam-like moments: v ~ g^2 averages (some exact zeros), m ~ +-sqrt(v) scaled."""
    v = (rng.standard_normal(shape) ** 2 * 1e-4).astype(np.float32)
    v.reshape(-1)[::7] = 0.0
    m = (rng.standard_normal(shape) * np.sqrt(v) * 0.5).astype(np.float32)
    m.reshape(-1)[::7] = 0.0
    return m, v


def optax_state(seed=0):
    """(tx, state, params) of optax.adam with numpy-drawn moments at count 5."""
    import jax.numpy as jnp
    import optax
    rng = np.random.default_rng(seed)
    params = {"a": jnp.asarray(rng.standard_normal(300).astype(np.float32)),
              "b": {"c": jnp.asarray(rng.standard_normal((17, 5)).astype(np.float32))}}
    tx = optax.adam(LR)
    st = tx.init(params)
    mu, nu = {}, {}
    for k, shape in (("a", (300,)), ("c", (17, 5))):
        mu[k], nu[k] = _moments(rng, shape, 5)
    adam = st[0]._replace(count=jnp.asarray(5, jnp.int32), mu={"a": jnp.asarray(mu["a"]), "b": {"c": jnp.asarray(mu["c"])}},
                          nu={"a": jnp.asarray(nu["a"]), "b": {"c": jnp.asarray(nu["c"])}})
    return tx, (adam,) + tuple(st[1:]), params


def torch_state(seed=0):
    """(model, Adam optimizer) with numpy-drawn parameters and moments at step 5."""
    import torch
    rng = np.random.default_rng(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 7))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32) * 0.1))
    opt = torch.optim.Adam(model.named_parameters(), lr=LR, foreach=False)
    for p in model.parameters():
        m, v = _moments(rng, tuple(p.shape), 5)
        opt.state[p] = {"step": torch.tensor(5.0), "exp_avg": torch.from_numpy(m), "exp_avg_sq": torch.from_numpy(v)}
    return model, opt


def _hashes(data):
    """SHA-256 of the payload and of the decoded moments, whatever integrity hash the file
    itself carries: the record says the bytes are the same, not that the file is sealed alike."""
    import hashlib
    from jaxguard.format import reader
    h, payload = reader.parse(data)
    return [hashlib.sha256(payload).hexdigest(), reader.decoded_digest(h, payload, "sha256")]


def _file(path):
    with open(path, "rb") as fh:
        return _hashes(fh.read())


def write_optax_file(tmp, codec):
    import jaxguard as jg
    _, st, params = optax_state()
    path = os.path.join(tmp, f"optax-{codec}.jg")
    jg.save(path, st, params, lr=LR, codec=codec)
    return path


def write_sharded(tmp, codec):
    import jaxguard as jg
    _, st, params = optax_state()
    d = os.path.join(tmp, f"sharded-{codec}")
    jg.save(d, st, params, lr=LR, codec=codec, sharded=True)
    return d


def write_orbax(tmp, codec):
    import orbax.checkpoint as ocp
    from jaxguard import checkpoint as jgc
    _, st, params = optax_state()
    d = os.path.join(tmp, f"orbax-{codec}")
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(d, options=opts) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, lr=LR, codec=codec)))
    return d


def write_jit_hook(tmp, codec="log8-rel"):
    import jax
    import jaxguard as jg
    _, st, params = optax_state()
    k = jg.state_constants(st, params, lr=LR, codec=codec)
    enc = jax.jit(lambda s, p, k: jg.encode_state_jit(s, p, k))(st, params, k)
    d = os.path.join(tmp, f"jit-{codec}")
    jg.write(d, enc, k)
    return d


def write_torch_file(tmp, codec):
    import torch_compat
    _, opt = torch_state()
    path = os.path.join(tmp, f"torch-{codec}.jg")
    torch_compat.save(path, opt, codec=codec)
    return path


def write_torch_compress(tmp, codec):
    from torch_compat import state as tstate
    model, opt = torch_state()
    path = os.path.join(tmp, f"compress-{codec}.jg")
    tstate.compress_checkpoint_to(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3},
                                  codec=codec)
    return path


def write_dcp(tmp, codec):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch_compat.dcp import GuardedSavePlanner
    model, opt = torch_state()
    msd, osd = get_state_dict(model, opt)
    d = os.path.join(tmp, f"dcp-{codec}")
    planner = GuardedSavePlanner(codec=codec)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=d, planner=planner)
    return d, planner


def write_lightning(codec):
    from jaxguard.integrations.lightning import GuardedCheckpointIO
    model, opt = torch_state()
    data, _ = GuardedCheckpointIO(codec=codec).to_bytes({"state_dict": model.state_dict(),
                                                         "optimizer_states": [opt.state_dict()], "epoch": 1})
    return data


def dcp_containers(planner):
    return [b for b in planner._blobs.values() if isinstance(b, (bytes, bytearray)) and bytes(b[:8]) == b"JAXGUARD"]


def all_hashes(tmp, codecs=CODECS) -> dict:
    """{path/codec: [payload sha256, decoded sha256] (or a sorted list of them for a directory)}."""
    out = {}
    for codec in codecs:
        out[f"optax-file/{codec}"] = _file(write_optax_file(tmp, codec))
        out[f"sharded/{codec}"] = sorted(_file(f) for f in glob.glob(write_sharded(tmp, codec) + "/*.jaxguard"))
        out[f"orbax/{codec}"] = sorted(_file(f) for f in glob.glob(write_orbax(tmp, codec) + "/**/*.jaxguard",
                                                                    recursive=True))
        out[f"torch-file/{codec}"] = _file(write_torch_file(tmp, codec))
        out[f"torch-compress/{codec}"] = _file(write_torch_compress(tmp, codec))
        out[f"dcp/{codec}"] = sorted(_hashes(b) for b in dcp_containers(write_dcp(tmp, codec)[1]))
        out[f"lightning/{codec}"] = _hashes(write_lightning(codec))
    out["jit-hook/log8-rel"] = sorted(_file(f) for f in glob.glob(write_jit_hook(tmp) + "/*.jaxguard"))
    return out


if __name__ == "__main__":
    import tempfile
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    res = all_hashes(tempfile.mkdtemp())
    with open(sys.argv[1], "w") as fh:
        json.dump(res, fh, indent=1, sort_keys=True)
    print(json.dumps(res, indent=1, sort_keys=True))
