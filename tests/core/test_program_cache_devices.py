"""jaxguard.core.programs across host device counts: ``--xla_force_host_platform_device_count``
is not part of a stored program's key (the multi-process tests' ranks and a plain process
share one cache), and that is safe: every stored program is lowered for one device, so a
process with 4 devices loads the very executable a process with 1 stored (and the other
way round), computes the same bits, and an argument placed on another device or sharded
over all of them goes through jax's own dispatch, never through a program made for
another placement (the loaded program is one device's; before, a 1-device program loaded
into a 4-device process failed its first call: "expected 4 shards")."""
import json
import os
import subprocess
import sys

import pytest

from jaxguard.core import programs

_PROBE = r"""
import hashlib, json, os, pickle, sys
ndev, directory, other = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
os.environ["XLA_FLAGS"] = " ".join(other + [f"--xla_force_host_platform_device_count={ndev}"])
import jax, numpy as np
from jax.experimental import serialize_executable
from jaxguard.core import bound as B, programs
from jaxguard.core.config import GuardConfig
assert len(jax.devices()) == ndev
programs.enable(directory)
rng = np.random.default_rng(5)
m = (rng.standard_normal(512) * 1e-3).astype(np.float32)
m[:4] = [0.0, 2.0**-149, 1.0e19, -1e-30]
v = (m.astype(np.float64) ** 2 * 2).astype(np.float32)   # 2e38 and a subnormal among them
K = B.stack_rows([B.pack_constants(GuardConfig(lr=1e-3, step=3).constants(), 0.01)])
args = (K.take(np.zeros(512, np.int64)), m, v, m * np.float32(1.001), v * np.float32(0.999), np.full(512, 0.2, np.float32))
bits = lambda r: hashlib.sha256(np.asarray(r).tobytes()).hexdigest()
direct = bits(B.batch_lower_pc(*args))
out = {"cached": bits(programs.call(B.batch_lower_pc, *args)), "direct": direct, **programs.counts()}
stored = []   # the devices each stored program runs on, as this process loads it
for name in sorted(f for f in os.listdir(directory) if f.endswith(programs.SUFFIX)):
    with open(os.path.join(directory, name), "rb") as fh:
        body = programs.unwrap_entry(fh.read(), name[:-len(programs.SUFFIX)])
    exe = serialize_executable.deserialize_and_load(*pickle.loads(body))
    placed = [s for s in exe.input_shardings[0] if s is not None] + jax.tree_util.tree_leaves(exe.output_shardings)
    stored.append(sorted({d.id for s in placed for d in s.device_set}))   # (None: an argument XLA dropped)
out["stored_devices"] = stored
if ndev > 1:   # placements no stored program was made for: jax's dispatch, the same bits
    last = jax.devices()[-1]
    out["on_last_device"] = bits(programs.call(B.batch_lower_pc, *jax.device_put(args, last)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    spread_args = jax.device_put(args, spread)
    out["sharded"] = bits(programs.call(B.batch_lower_pc, *spread_args))
    out["sharded_direct"] = bits(B.batch_lower_pc(*spread_args))
print(json.dumps(out))
"""


def _probe(ndev, directory, *other_flags):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run([sys.executable, "-c", _PROBE, str(ndev), str(directory), *other_flags], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first, then", [(1, 4), (4, 1)])
def test_processes_with_other_device_counts_share_one_single_device_program(tmp_path, first, then):
    d = tmp_path / "programs"
    a = _probe(first, d)
    assert (a["compiled"], a["loaded"]) == (1, 0) and a["cached"] == a["direct"]
    b = _probe(then, d)
    assert (b["compiled"], b["loaded"]) == (0, 1)        # the other count's program, loaded
    assert b["cached"] == b["direct"] == a["direct"]       # bit for bit, in both processes
    assert a["stored_devices"] == b["stored_devices"] == [[0]]   # one program, for device 0 only
    many = a if first > 1 else b
    assert many["on_last_device"] == a["direct"]
    assert many["sharded"] == many["sharded_direct"]   # (XLA's partitioned program: its own bits)


def test_another_flag_beside_the_device_count_still_keys_its_own_program(tmp_path):
    """The control: only the device count is left out; a process whose other XLA flags
    differ compiles and stores its own program."""
    d = tmp_path / "programs"
    assert _probe(1, d)["compiled"] == 1
    c = _probe(4, d, "--xla_cpu_enable_fast_math=false")
    assert (c["compiled"], c["loaded"]) == (1, 0) and c["cached"] == c["direct"]
    assert len(c["stored_devices"]) == 2
