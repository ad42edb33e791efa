"""Multi-process JAX: 2 processes x 2 CPU devices (gloo) save an optax adamw state sharded
over the global mesh with `jaxguard.save` and orbax `GuardedSave`, restore it in the same
job and in a separate 1-process x 4-device job with other shardings; the jitted
whole-state hook (`encode_state_jit` + `write`) is checked against `jaxguard.save`.

The jobs run tests/mp_jax_worker.py as subprocesses (jax.distributed needs one process
per JAX process); they write JSON reports that this module asserts on.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "..", "mp_jax_worker.py")
TIMEOUT = 1200


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mp"))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "write", str(i), "2", str(port), out], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    r = subprocess.run([sys.executable, WORKER, "read", out], env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    w = [json.load(open(os.path.join(out, f"write_{i}.json"))) for i in range(2)]
    return w, json.load(open(os.path.join(out, "read.json"))), out


def test_topology(reports):
    w, rd, _ = reports
    assert [x["devices"] for x in w] == [4, 4] and [x["local_devices"] for x in w] == [2, 2]
    assert rd["devices"] == 4


def test_each_process_certifies_only_its_shards(reports):
    w, _, out = reports
    total = w[0]["save"]["total"]["coordinates"]
    for x in w:
        assert x["save"]["coordinates"] == x["expected_share"], x
        assert 0 < x["save"]["coordinates"] < total
        assert x["file_holds_exactly_my_shards"], x
    assert sum(x["save"]["coordinates"] for x in w) == total == 64 * 96 + 96 + 96 * 16 + 200 * 16
    files = sorted(f for f in os.listdir(os.path.join(out, "jg")))
    sid = json.load(open(os.path.join(out, "jg", "manifest.json")))["save_id"]
    assert files == ["manifest.json", f"process_00000.{sid}.jaxguard", f"process_00001.{sid}.jaxguard"]


def test_restores_decode_the_same_bits_in_any_topology(reports):
    w, rd, _ = reports
    for x in w:
        assert x["restored_sharding_is_like"]
        assert x["digest_jg"] == x["digest_orb"] == rd["digest_jg"] == rd["digest_orb"]
        assert x["digest_jit"] == x["digest_jg9"] == rd["digest_jit"] == rd["digest_jg9"]
    assert w[0]["digest_jg"] != w[0]["digest_jg9"]


@pytest.mark.parametrize("tag", ["jg", "orb", "jit", "jg9"])
def test_first_update_audit(reports, tag):
    _, rd, _ = reports
    a = rd[f"audit_{tag}"]
    # 44 grid gradients + 1 uniform draw + 1 real loss gradient, all coordinates
    assert a["gradients"] == 46 and a["coordinates"] == 64 * 96 + 96 + 96 * 16 + 200 * 16
    assert a["violations"] == 0, a
    assert rd[f"changed_{tag}"] > 0   # the moments really were coded


def test_jit_hook_traces_once(reports):
    w, _, _ = reports
    for x in w:
        assert x["jit_traces"] == 1
        assert x["write"]["coordinates"] == x["save"]["total"]["coordinates"]
