"""Containers through fsspec URLs: memory://, file://, and a real S3 API (moto's server on
localhost, reached by s3fs over HTTP). A writer SIGKILLed mid-upload leaves the previous
object intact: the upload goes through a throttling TCP relay that counts the bytes it
forwarded, so the kill provably lands after the upload started and before it ended."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat  # noqa: E402
from jaxguard.format import container, storage  # noqa: E402
from jaxguard.errors import ContainerError  # noqa: E402

fsspec = pytest.importorskip("fsspec")


def _optimizer(seed=0, n=3000, steps=5):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(n // 50, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False, fused=False)
    x = torch.randn(64, n // 50)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _fresh_like(model):
    m2 = type(model)(*[type(l)(l.in_features, l.out_features) if isinstance(l, torch.nn.Linear) else type(l)()
                       for l in model])
    m2.load_state_dict(model.state_dict())
    return m2, torch.optim.AdamW(m2.parameters(), lr=1e-3, foreach=False, fused=False)


def _same_state(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert float(sa[k]["step"]) == float(sb[k]["step"])


@pytest.mark.parametrize("url", ["memory://jg-test/run1/opt.jg", "file://{tmp}/opt.jg", "{tmp}/opt.jg"])
def test_torch_round_trip_through_url(url, tmp_path):
    url = url.format(tmp=tmp_path)
    model, opt = _optimizer()
    summary = torch_compat.save(url, opt)
    assert storage.size(url) == summary["container_bytes"]
    m2, opt2 = _fresh_like(model)
    torch_compat.load(url, opt2)
    _same_state(opt, opt2)
    # the container read back from the URL holds what a local write holds, and passes the numpy reader
    local = tmp_path / "local.jg"
    torch_compat.save(local, opt)
    (h_url, _, _), (h_loc, _, _) = container.read(url), container.read(local)
    assert (h_url["payload_sha256"], h_url["decoded_sha256"]) == (h_loc["payload_sha256"], h_loc["decoded_sha256"])
    from jaxguard.format import reader
    assert reader.verify_bytes(storage.read_bytes(url))["ok"]


def test_memory_write_leaves_no_temporary_keys():
    fs = fsspec.filesystem("memory")
    url = "memory://jg-tmpkeys/a/b.jg"
    storage.atomic_write(url, b"first")
    storage.atomic_write(url, b"second")
    assert fs.ls("/jg-tmpkeys/a", detail=False) == ["/jg-tmpkeys/a/b.jg"]
    assert storage.read_bytes(url) == b"second"


def test_corrupt_remote_object_refused():
    model, opt = _optimizer()
    url = "memory://jg-corrupt/opt.jg"
    torch_compat.save(url, opt)
    data = bytearray(storage.read_bytes(url))
    data[len(data) // 2] ^= 0x10
    fsspec.filesystem("memory").pipe_file("/jg-corrupt/opt.jg", bytes(data))
    with pytest.raises(ContainerError, match="SHA-256|sha256|checksum"):
        container.read(url)


def test_missing_url_one_line_error():
    with pytest.raises(ContainerError, match=r"memory://jg-none/x\.jg: no such file"):
        container.read("memory://jg-none/x.jg")
    with pytest.raises(ContainerError, match="no fsspec filesystem"):
        storage.read_bytes("nosuchproto://a/b")


def test_optax_round_trip_through_memory_url():
    import jax.numpy as jnp
    import optax
    import jaxguard
    params = {"w": jnp.linspace(-1, 1, 600, dtype=jnp.float32).reshape(20, 30)}
    tx = optax.adam(1e-3)
    state = tx.init(params)
    for i in range(3):
        g = {"w": jnp.sin(params["w"] * (i + 1)) * 0.1}
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
    url = "memory://jg-optax/state.jg"
    jaxguard.save(url, state, params, lr=1e-3)
    restored = jaxguard.load(url, tx.init(params))
    assert int(restored[0].count) == int(state[0].count)


# ---------------------------------------------------------------- a real S3 API on localhost
class _Relay:
    """TCP relay 127.0.0.1:port -> target; client->server bytes are forwarded in 64 KiB
    slices at most `rate` bytes/s and counted in `.up`."""

    def __init__(self, target, rate):
        self.target, self.rate, self.up = target, rate, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, False), daemon=True).start()

    def _pipe(self, src, dst, upstream):
        try:
            while True:
                b = src.recv(65536)
                if not b:
                    break
                if upstream:
                    self.up += len(b)
                    time.sleep(len(b) / self.rate)
                dst.sendall(b)
        except OSError:
            pass
        finally:
            for x in (src, dst):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    conf_old = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.mkdir("jg-bucket")
    try:
        yield {"endpoint": endpoint, "port": port, "fs": fs, "env": env}
    finally:
        if conf_old is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = conf_old
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_s3_round_trip(s3):
    model, opt = _optimizer(seed=1)
    url = "s3://jg-bucket/run/opt.jg"
    summary = torch_compat.save(url, opt)
    assert s3["fs"].size("jg-bucket/run/opt.jg") == summary["container_bytes"]
    m2, opt2 = _fresh_like(model)
    torch_compat.load(url, opt2)
    _same_state(opt, opt2)
    for k, st in opt.state_dict()["state"].items():  # the stored state is the guarded one: audit it
        assert opt2.state_dict()["state"][k]["exp_avg"].shape == st["exp_avg"].shape
    with pytest.raises(ContainerError, match="no such file"):
        container.read("s3://jg-bucket/run/missing.jg")


def test_s3_cli_inspect_verify_restore(s3, capsys):
    """The CLI on s3:// URLs, in-process (the console script's code path; the filesystem
    options come from the fsspec configuration the fixture set)."""
    from jaxguard import cli
    model, opt = _optimizer(seed=2)
    url = "s3://jg-bucket/cli/opt.jg"
    torch_compat.save(url, opt)
    capsys.readouterr()
    assert cli.main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["container_bytes"] == storage.size(url)
    assert cli.main(["verify", url]) == 0
    assert capsys.readouterr().out.startswith(f"ok {url} (a jaxguard container file):")
    out = "s3://jg-bucket/cli/restored.pt"
    assert cli.main(["restore", url, "-o", out]) == 0
    import io
    restored = torch.load(io.BytesIO(storage.read_bytes(out)), weights_only=True)
    assert restored["optimizer"]["state"].keys() == opt.state_dict()["state"].keys()
    assert cli.main(["verify", "s3://jg-bucket/cli/missing.jg"]) == 1
    assert "no such file" in capsys.readouterr().out


_WRITER = textwrap.dedent("""
    import os, sys
    import fsspec
    fsspec.config.conf["s3"] = {"endpoint_url": sys.argv[1]}
    from jaxguard.format import storage
    data = open(sys.argv[3], "rb").read()
    print("start", flush=True)
    storage.atomic_write(sys.argv[2], data)
    print("done", flush=True)
""")


def test_writer_killed_mid_upload_leaves_previous_object(s3, tmp_path):
    model, opt = _optimizer(seed=3)
    url = "s3://jg-bucket/kill/opt.jg"
    torch_compat.save(url, opt)
    before = storage.read_bytes(url)
    new = tmp_path / "new.bin"
    new.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    relay = _Relay(("127.0.0.1", s3["port"]), rate=4 << 20)  # 8 MiB at 4 MiB/s: ~2 s of upload
    try:
        env = {**os.environ, **s3["env"]}
        p = subprocess.Popen([sys.executable, "-c", _WRITER, f"http://127.0.0.1:{relay.port}", url, str(new)],
                             stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout.readline().strip() == "start"
        deadline = time.monotonic() + 60
        while relay.up < (2 << 20) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.01)
        sent = relay.up
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert (1 << 20) < sent < (8 << 20) - (1 << 20), f"kill did not land mid-upload ({sent} bytes sent)"
    finally:
        relay.close()
    time.sleep(0.5)  # let the server finish with the broken request
    s3["fs"].invalidate_cache()
    assert storage.read_bytes(url) == before
    container.read(url)  # all checksums pass
    m2, opt2 = _fresh_like(model)
    torch_compat.load(url, opt2)
    _same_state(opt, opt2)
    assert s3["fs"].ls("jg-bucket/kill", detail=False) == ["jg-bucket/kill/opt.jg"]


def test_import_jaxguard_imports_no_integration_or_fsspec():
    code = ("import sys, jaxguard, jaxguard.format.storage, jaxguard.integrations; "
            "bad = [m for m in ('fsspec', 's3fs', 'transformers', 'accelerate', 'lightning', 'torch', 'jax') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_compress_streams_to_a_url(tmp_path, capsys):
    """`jaxguard compress CKPT -o memory://...`: the streaming writer commits a URL the same
    way (scratch payload in the temporary directory, one atomic put of the whole file)."""
    from jaxguard import cli
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 20)).pow(2).mean().backward()
        opt.step()
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    url = "memory://jg-stream/opt.jg"
    assert cli.main(["compress", str(src), "-o", url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["container_bytes"] == storage.size(url)
    restored, _ = torch_compat.restore_tree(url)
    assert restored["optimizer"]["state"].keys() == opt.state_dict()["state"].keys()
    storage.remove(url)


def test_published_file_honours_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        storage.atomic_write(tmp_path / "a.jg", b"x")
        container.atomic_write_with(str(tmp_path / "b.jg"), lambda fh: fh.write(b"y"))
        os.umask(0o077)
        storage.atomic_write(tmp_path / "c.jg", b"z")
    finally:
        os.umask(old)
    modes = [os.stat(tmp_path / n).st_mode & 0o777 for n in ("a.jg", "b.jg", "c.jg")]
    assert modes == [0o644, 0o644, 0o600]      # what open(path, "wb") / torch.save give


@pytest.mark.parametrize("base", ["memory://jg-dirops/{u}", "{tmp}/d"])
def test_directory_operations_local_and_url(base, tmp_path):
    import uuid
    d = base.format(u=uuid.uuid4().hex, tmp=tmp_path)
    assert not storage.is_dir(d) and storage.listdir(d) == []
    storage.mkdir(d)
    storage.atomic_write(storage.join(d, "b.bin"), bytes(range(100)))
    storage.atomic_write(storage.join(d, "a.bin"), b"abc")
    assert storage.is_dir(d) and not storage.is_dir(storage.join(d, "a.bin"))
    assert storage.listdir(d) == ["a.bin", "b.bin"]
    assert storage.read_range(storage.join(d, "b.bin"), 10, 14) == bytes([10, 11, 12, 13])
    storage.remove(storage.join(d, "a.bin"))
    storage.remove(storage.join(d, "a.bin"))     # a missing one is fine
    assert storage.listdir(d) == ["b.bin"]
    with pytest.raises(ContainerError, match="no such file"):
        storage.read_range(storage.join(d, "a.bin"), 0, 1)


def test_storage_does_not_import_the_container_writer():
    code = "import sys, jaxguard.format.storage; print('jaxguard.format.container' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))})
    assert out.stdout.strip() == "False", out.stderr[-500:]


def test_a_local_write_removes_what_a_killed_writer_left_of_the_same_target(tmp_path):
    """SIGKILL leaves ``.<name>.<random>.tmp``; the next write of that target removes it once
    it is older than STALE_TMP_SECONDS, and keeps a fresh one (a live concurrent writer's)
    and other targets' files."""
    from jaxguard.format import storage
    target = tmp_path / "last.ckpt"
    stale, fresh = tmp_path / storage.tmp_name("last.ckpt"), tmp_path / storage.tmp_name("last.ckpt")
    other = tmp_path / storage.tmp_name("other.ckpt")
    for p in (stale, fresh, other):
        p.write_bytes(b"partial")
    old = time.time() - storage.STALE_TMP_SECONDS - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    storage.atomic_write(str(target), b"complete")
    assert target.read_bytes() == b"complete"
    assert not stale.exists() and fresh.exists() and other.exists()


def test_atomic_directory_publishes_whole_or_leaves_nothing(tmp_path):
    """A new directory appears complete in one rename; a failure inside the block leaves
    neither it nor its staging directory; a non-empty target or a missing parent is refused."""
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError, match="stopped"):
        with storage.atomic_directory(dst) as stage:
            with open(os.path.join(stage, "half.bin"), "wb") as fh:
                fh.write(b"x")
            raise RuntimeError("stopped half way")
    assert os.listdir(tmp_path) == []
    dst.mkdir()                                   # an empty directory is replaced
    with storage.atomic_directory(dst) as stage:
        os.mkdir(os.path.join(stage, "sub"))
        for name in ("a.bin", os.path.join("sub", "b.bin")):
            with open(os.path.join(stage, name), "wb") as fh:
                fh.write(name.encode())
        assert not os.path.exists(dst / "a.bin")  # nothing visible before the block ends
    assert os.listdir(tmp_path) == ["out"]
    assert (dst / "a.bin").read_bytes() == b"a.bin" and (dst / "sub" / "b.bin").read_bytes() == b"sub/b.bin"
    with pytest.raises(ContainerError, match="not an empty directory"):
        with storage.atomic_directory(dst):
            pass
    with pytest.raises(ContainerError, match="does not exist; create it first"):
        with storage.atomic_directory(tmp_path / "missing" / "out"):
            pass
    assert os.listdir(tmp_path) == ["out"]
