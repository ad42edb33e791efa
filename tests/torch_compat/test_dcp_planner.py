"""GuardedLoadPlanner reads where DCP's metadata says the checkpoint is
(``storage_meta.checkpoint_id``), or where it is told (no frame walking): checkpoint_id=
or the same storage_reader= as dcp.load, and a one-line error for anything else; the
GuardedFileSystemReader reads .metadata without running code."""
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from jaxguard.errors import CheckpointError, ConfigError  # noqa: E402
from torch_compat.dcp import GuardedFileSystemReader, GuardedLoadPlanner  # noqa: E402


def _saved(path, seed):
    torch.manual_seed(seed)
    state = {"model": torch.nn.Linear(4, 3).state_dict()}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def _target():
    return {"model": {k: torch.zeros_like(v) for k, v in torch.nn.Linear(4, 3).state_dict().items()}}


def test_planner_reads_where_it_is_told(tmp_path):
    a = _saved(tmp_path / "a", 0)
    _saved(tmp_path / "b", 1)
    got = _target()
    dcp.load(got, checkpoint_id=str(tmp_path / "a"), planner=GuardedLoadPlanner(str(tmp_path / "a")), no_dist=True)
    assert all(torch.equal(got["model"][k], a["model"][k]) for k in a["model"])
    fs = GuardedFileSystemReader(str(tmp_path / "a"))
    got = _target()
    dcp.load(got, storage_reader=fs, planner=GuardedLoadPlanner(storage_reader=fs), no_dist=True)
    assert all(torch.equal(got["model"][k], a["model"][k]) for k in a["model"])


def test_planner_without_arguments_reads_where_the_metadata_says(tmp_path, monkeypatch):
    """The call DCP users write: GuardedLoadPlanner() finds the directory in the metadata
    dcp.load read; where that path no longer holds the checkpoint, one line."""
    a = _saved(tmp_path / "a", 0)
    got = _target()
    dcp.load(got, checkpoint_id=str(tmp_path / "a"), planner=GuardedLoadPlanner(), no_dist=True)
    assert all(torch.equal(got["model"][k], a["model"][k]) for k in a["model"])
    # a checkpoint moved since it was saved: its metadata names a path that holds nothing
    (tmp_path / "a").rename(tmp_path / "moved")
    err = _load_error(checkpoint_id=str(tmp_path / "moved"), planner=GuardedLoadPlanner())
    assert isinstance(err, CheckpointError) and "GuardedLoadPlanner(checkpoint_id=path)" in str(err), err
    assert "\n" not in str(err) and "holds no DCP checkpoint" in str(err)
    got = _target()
    dcp.load(got, checkpoint_id=str(tmp_path / "moved"), planner=GuardedLoadPlanner(str(tmp_path / "moved")),
             no_dist=True)
    assert all(torch.equal(got["model"][k], a["model"][k]) for k in a["model"])
    # another checkpoint now at the saved path: its save id differs
    _saved(tmp_path / "a", 1)
    err = _load_error(checkpoint_id=str(tmp_path / "moved"), planner=GuardedLoadPlanner())
    assert isinstance(err, CheckpointError) and "holds another checkpoint" in str(err), err
    # a relative path saved from another working directory
    monkeypatch.chdir(tmp_path)
    _saved("b", 2)
    monkeypatch.chdir(tmp_path / "a")
    err = _load_error(checkpoint_id=str(tmp_path / "b"), planner=GuardedLoadPlanner())
    assert isinstance(err, CheckpointError) and "relative path" in str(err), err


def test_a_plain_reader_given_to_the_planner_warns_that_metadata_was_unpickled(tmp_path):
    import warnings
    from jaxguard.errors import JaxguardWarning
    a = _saved(tmp_path / "a", 0)
    for reader, warns in ((FileSystemReader, True), (GuardedFileSystemReader, False)):
        fs, got = reader(str(tmp_path / "a")), _target()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", JaxguardWarning)
            dcp.load(got, storage_reader=fs, planner=GuardedLoadPlanner(storage_reader=fs), no_dist=True)
        msgs = [str(w.message) for w in seen if issubclass(w.category, JaxguardWarning)]
        assert all(torch.equal(got["model"][k], a["model"][k]) for k in a["model"])
        if warns:
            assert len(msgs) == 1 and "plain pickle.load" in msgs[0] and "GuardedFileSystemReader" in msgs[0], msgs
        else:
            assert msgs == []


def test_guarded_reader_refuses_a_metadata_pickle_that_runs_code(tmp_path):
    """A .metadata naming os.system: torch's reader runs it inside dcp.load (the control), the
    guarded reader refuses it in one line and nothing runs."""
    import os
    import pickle
    canary = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    _saved(tmp_path / "a", 0)
    (tmp_path / "a" / ".metadata").write_bytes(pickle.dumps(Evil()))
    r = GuardedFileSystemReader(str(tmp_path / "a"))
    err = _load_error(storage_reader=r, planner=GuardedLoadPlanner(storage_reader=r))
    # torch wraps the reader's error: "metadata is None; global metadata read failed: <it>; rank local ..."
    assert "refused without running it (UnpicklingError: names posix.system, which a DCP save never writes)" in \
        str(err), err
    assert "\n" not in str(err) and not canary.exists()
    r = FileSystemReader(str(tmp_path / "a"))
    _load_error(storage_reader=r, planner=GuardedLoadPlanner(storage_reader=r))   # fails after the pickle ran
    assert canary.exists()          # the control: torch's own reader ran the pickle's command


def _load_error(**kw):
    with pytest.raises(BaseException) as info:
        dcp.load(_target(), no_dist=True, **kw)
    failures = getattr(info.value, "failures", None)   # DCP wraps a rank's error
    return next(iter(failures.values()))[0] if failures else info.value


def test_planner_with_two_places_or_another_one_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        GuardedLoadPlanner(str(tmp_path / "a"), storage_reader=GuardedFileSystemReader(str(tmp_path)))
    _saved(tmp_path / "a", 0)
    _saved(tmp_path / "b", 1)
    err = _load_error(checkpoint_id=str(tmp_path / "a"), planner=GuardedLoadPlanner(str(tmp_path / "b")))
    assert isinstance(err, CheckpointError) and "holds another checkpoint" in str(err), err
    err = _load_error(checkpoint_id=str(tmp_path / "a"),
                      planner=GuardedLoadPlanner(storage_reader=GuardedFileSystemReader(str(tmp_path / "a"))))
    assert isinstance(err, CheckpointError) and "not the storage reader dcp.load" in str(err), err
    assert "\n" not in str(err)


def test_a_moment_restored_onto_another_device_than_its_op_model_warns(tmp_path):
    """The manifest records each moment's op model; restoring a CUDA-certified state onto
    CPU tensors warns in one line, a CPU-certified one does not."""
    import warnings
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from jaxguard.errors import JaxguardWarning
    from torch_compat.dcp import GuardedSavePlanner
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    for name, op_model in (("cpu", None), ("cuda", "torch-adam-cuda-foreach")):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / name),
                 planner=GuardedSavePlanner(op_model=op_model), no_dist=True)
    for name in ("cpu", "cuda"):
        msd, osd = get_state_dict(model, opt)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", JaxguardWarning)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / name),
                     planner=GuardedLoadPlanner(str(tmp_path / name)), no_dist=True)
        msgs = [str(w.message) for w in seen if issubclass(w.category, JaxguardWarning)]
        if name == "cpu":
            assert msgs == []
        else:
            assert len(msgs) == 1 and "torch-adam-cuda-foreach (cuda) but is restored onto cpu" in msgs[0]
