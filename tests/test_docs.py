"""The docs run: every ```python block of the README, docs/api.md, docs/dcmha.md and
docs/finetune.md, docs/deploying.md, and every relative link of the README and docs/*.md
resolves.

Each block runs on its own, in a fresh namespace and an empty working directory, so every
snippet is pasteable as it stands. A block preceded by the line ``<!-- slow -->`` is marked
slow (it takes more than ~10 s on 2 CPU cores).
"""
import importlib.util
import re
from pathlib import Path
from typing import List, NamedTuple

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_DOCS = ("api.md", "dcmha.md", "finetune.md", "deploying.md", "../README.md")
LINK_DOCS = tuple(sorted(p.name for p in DOCS.glob("*.md"))) + ("../README.md",)
FENCE = re.compile(r"^```(\w*)\s*$")


class Block(NamedTuple):
    doc: str
    line: int           # 1-based line of the opening fence
    code: str
    slow: bool


def python_blocks(doc: str, text: str = None) -> List[Block]:
    """The ```python blocks of ``docs/<doc>`` (or of ``text``), in order."""
    lines = ((DOCS / doc).read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{doc}:{start + 1}: code block is never closed")
        i += 1
        if lang == "python":
            prev = next((l.strip() for l in reversed(lines[:start]) if l.strip()), "")
            blocks.append(Block(doc, start + 1, "\n".join(body) + "\n", prev == "<!-- slow -->"))
    return blocks


def _params():
    out = []
    for doc in RUN_DOCS:
        for b in python_blocks(doc):
            marks = [pytest.mark.slow] if b.slow else []
            out.append(pytest.param(b, id=f"{b.doc}:{b.line}", marks=marks))
    return out


@pytest.mark.parametrize("block", _params())
def test_python_block_runs(block: Block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(block.code, f"{DOCS / block.doc}:{block.line}", "exec")
    exec(code, {"__name__": "__main__"})


def test_block_parser():
    text = "# T\n```python\na = 1\n```\n\n<!-- slow -->\n\n```python\nb = 2\nc = 3\n```\n```\nshell\n```\n"
    blocks = python_blocks("x.md", text)
    assert [(b.line, b.code, b.slow) for b in blocks] == [(2, "a = 1\n", False), (8, "b = 2\nc = 3\n", True)]
    with pytest.raises(AssertionError, match="never closed"):
        python_blocks("x.md", "```python\na = 1\n")


def test_every_doc_has_python_blocks():
    for doc in RUN_DOCS:
        assert len(python_blocks(doc)) >= (1 if doc.endswith("README.md") else 3), doc


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


FENCED = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set:
    text = FENCED.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("doc", LINK_DOCS)
def test_links_resolve(doc):
    path = DOCS / doc
    text = FENCED.sub("", path.read_text())
    links = LINK.findall(text)
    assert links or doc not in RUN_DOCS, doc
    for link in links:
        if re.match(r"https?://", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{doc}: link to missing file {link!r}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{doc}: no heading for anchor {link!r} in {file.name}"


@pytest.mark.parametrize("name", ["compose.png", "attention_maps_digit.png"])
def test_figures_are_small_valid_pngs(name):
    png = DOCS / "figures" / name
    assert png.stat().st_size < 300 * 1024
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and min(img.size) >= 400


def test_figure_data_is_compose_applied_per_token():
    """The figure's maps satisfy A'[:,t,s] = (I + Mq[t] + Mk[s])^T A[:,t,s] (checked by the
    script itself before drawing), and composition visibly changed them."""
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    ex = mf.compose_example()
    mf._check(ex)
    assert (ex["out"] - ex["a"]).abs().max() > 0.1
