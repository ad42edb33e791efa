"""`jaxguard demo`: the quick demo (the README's first command) prints the default codec's
row beside unguarded block8, with figures the run computed: the guarded row passes the real
torch Adam audit, the unguarded one violates it; ``--full`` compresses every way the paper
compares; the program counts say whether this run compiled the guard's programs."""
import gc
import json
import pytest

pytest.importorskip("torch")

from jaxguard.cli import demo  # noqa: E402


def test_quick_demo_shows_the_guard_against_unguarded_block8(capsys):
    assert demo.run_demo(as_json=True) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == demo.QUICK[0] and not out["full"]
    rows = {r["codec"]: r for r in out["rows"]}
    assert list(rows) == [r[1] for r in demo.QUICK_ROWS] == ["log8-rel-zstd", "block8-unguarded"]
    assert rows["log8-rel-zstd"]["violations"] == 0 and rows["log8-rel-zstd"]["reader_ok"]
    assert rows["log8-rel-zstd"]["escapes"] > 0   # some coordinates stored exactly: the guard at work
    assert rows["log8-rel-zstd"]["max_gap_lr"] <= 0.01
    assert rows["block8-unguarded"]["violations"] > 0   # the negative control the demo shows
    assert 0 < rows["log8-rel-zstd"]["payload_ratio"] < rows["block8-unguarded"]["payload_ratio"]


def test_the_table_says_where_the_programs_came_from():
    assert demo.programs_line({"compiled": 15, "loaded": 0}).startswith("15 guard programs compiled and stored")
    assert demo.programs_line({"compiled": 0, "loaded": 15}) == "15 guard programs loaded from the program cache"
    assert "program cache is off" in demo.programs_line({"compiled": 0, "loaded": 0})


def test_full_demo_lists_every_row(capsys):
    assert demo.run_demo(steps=3, as_json=True, full=True) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["row"] for r in out["rows"]] == [r[0] for r in demo.ROWS]
    assert out["full"] and out["steps"] == 3
    assert out["programs"]["compiled"] + out["programs"]["loaded"] > 0


def test_the_cli_demo_gives_the_collector_back(capsys):
    """`jaxguard demo` runs without the cyclic collector and freezes what it made before the
    process exits; a caller in the same process collects again afterwards."""
    from jaxguard.cli.main import main
    assert gc.isenabled()
    assert main(["demo", "--steps", "2", "--json"]) == 0
    assert gc.isenabled()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
