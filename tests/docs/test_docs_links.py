"""Every file the README, CHANGELOG.md, docs/ and bench/README.md point at exists: a result
renamed or removed under bench/results (or a doc moved) takes its references with it.

A reference is a path under bench/ or docs/ (`bench/results/faults.md`, `docs/dcp.md`,
`bench/results/guarded_reproduction_{payload,escapes,gaps}.png`, a glob), resolved from the
repository root or from the document's own folder (bench/README.md says `results/...`), or
the bare name of a result file (`faults.md` after a full path in the same sentence), which
must name a file under bench/ or docs/. What a command writes (`--out PATH`) is not a
reference."""
import itertools
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", "CHANGELOG.md", "bench/README.md",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

# a path into bench/ or docs/ (bench/README.md's own `results/` and `experiments/` too), not
# inside a longer path or a URL
PATH = re.compile(r"(?<![\w/.:-])((?:bench|docs|results|experiments)/[\w./{},*+-]*[\w/*}])")
BARE = re.compile(r"(?<![\w/.{,-])([\w-]+(?:\.[\w-]+)*\.(?:md|json|jsonl|png|txt))\b")
# the flags before a path a command writes or fills, not one it reads
WRITTEN = re.compile(r"(?:--out|--cache|--work|--results|-o|>)[ =]$")
# names that are formats the software or the frameworks write, not files of this project
FORMAT_NAMES = {"manifest.json", "config.json", "trainer_state.json"}   # jaxguard's sharded; Hugging Face's


def _expand(path):
    """`a_{x,y}.{md,json}` -> a_x.md, a_x.json, a_y.md, a_y.json."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(doc, path):
    if any(seg and seg == seg.upper() and "." not in seg and seg.isidentifier() for seg in path.split("/")):
        return True                                   # a placeholder: bench/results/FILE, --src DIR
    bases = (ROOT, (ROOT / doc).parent)
    return all(any(any(base.glob(p)) if "*" in p else (base / p).exists() for base in bases)
               for p in _expand(path))


def _project_names():
    return {p.name for top in ("bench", "docs") for p in (ROOT / top).rglob("*") if p.is_file()}


def references(doc):
    text = (ROOT / doc).read_text()
    for m in PATH.finditer(text):
        if not WRITTEN.search(text[max(0, m.start() - 12):m.start()]):
            yield "path", m.group(1).split("**")[0], text.count("\n", 0, m.start()) + 1  # **bold**
    for m in BARE.finditer(text):
        yield "name", m.group(1), text.count("\n", 0, m.start()) + 1


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_referenced_file_exists(doc):
    names = _project_names() | {pathlib.Path(d).name for d in DOCUMENTS} | FORMAT_NAMES
    missing = [f"{doc}:{line}: {ref}" for kind, ref, line in references(doc)
               if not (_exists(doc, ref) if kind == "path" else ref in names)]
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_result(tmp_path, monkeypatch):
    """The negative control: a path to a removed result, a brace expansion with one missing
    member and the bare name of a removed result are each reported; a file that exists and
    a command's output path are not."""
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("See bench/results/faults.md and bench/results/codec_speed_removed.md,\n"
                   "bench/results/guarded_reproduction_{payload,nonexistent}.png, removed_result.md;\n"
                   "`python bench/fuzz/adversarial.py --out bench/results/new_run` writes a file.\n")
    for rel in ("bench/results/faults.md", "bench/results/guarded_reproduction_payload.png",
                "bench/fuzz/adversarial.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    refs = [(kind, ref) for kind, ref, _ in references("docs/x.md")]
    assert ("path", "bench/results/new_run") not in refs
    names = _project_names()
    bad = [ref for kind, ref in refs if not (_exists("docs/x.md", ref) if kind == "path" else ref in names)]
    assert bad == ["bench/results/codec_speed_removed.md",
                   "bench/results/guarded_reproduction_{payload,nonexistent}.png", "removed_result.md"]
