"""The Python examples in the docs run as written (a renamed public name breaks them here)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _block_under(doc, heading):
    """The first ```python block after `heading` in `doc`."""
    text = (ROOT / doc).read_text()
    start = text.index(heading)
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert m, f"no python block under {heading!r} in {doc}"
    return m.group(1)


@pytest.mark.parametrize("doc, heading", [("docs/optax.md", "## The core API: one moment pair")])
def test_snippet_runs(doc, heading, capsys):
    exec(compile(_block_under(doc, heading), f"{doc}:{heading}", "exec"), {})
    lines = capsys.readouterr().out.split()
    assert lines[-1] == "1"          # the jitted hook compiled once for two steps
    assert "block8-unguarded" in lines
