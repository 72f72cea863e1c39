"""Corpus builder (issue 6 item 3) on a small fixture directory: licences, cleaning, boilerplate
and duplicate removal, split, shards + manifest, determinism; then tokenizer + data on top of it.
Nothing here installs packages: the real build is `openk3 build-corpus --install` (DATA.md)."""

from __future__ import annotations

import hashlib
import json

import pytest

from openk3.datasets.corpus import (
    build_corpus, clean_text, directory_source, html_to_text, licence_is_permissive, load_manifest,
    module_docstrings, pypi_source, quality_reason, read_documents,
)
from openk3.train.data import DocumentStore, PackedLoader
from openk3.train.tokenizer_train import train_tokenizer

TOPICS = ["tables", "indexes", "queries", "graphs", "templates", "tokens", "matrices", "files", "threads", "caches",
          "streams", "schemas"]
FOOTER = "Copyright notice and navigation footer that every page of this manual repeats verbatim."


def _prose(i: int, topic: str) -> str:
    return (f"Chapter {i} is about {topic}. It explains how {topic} are created, how they are stored on disk, "
            f"and why the order of operations matters when {topic} change while other work is running. "
            f"The examples in chapter {i} use short names so that each step stays easy to follow.")


def _page(i: int, topic: str) -> str:
    return f"""<!DOCTYPE html><html><head><title>T{i}</title><style>p {{color: red}}</style></head><body>
<div class="related" role="navigation"><a href="x">previous</a> | <a href="y">next chapter link</a></div>
<div class="body" role="main"><h1>{topic.title()}<a class="headerlink" href="#h">¶</a></h1>
<p>{_prose(i, topic)}</p><ul><li>first &amp; second</li><li>third</li></ul>
<pre>for x in {topic}:
    print(x)</pre><p>{FOOTER}</p></div><script>var noise = "{topic} script";</script>
<div class="sphinxsidebar"><p>Sidebar search box and table of contents for {topic}</p></div></body></html>"""


@pytest.fixture(scope="module")
def fixture_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    html_dir, txt_dir = root / "html", root / "txt"
    (html_dir / "sub").mkdir(parents=True)
    txt_dir.mkdir()
    for i, topic in enumerate(TOPICS):
        (html_dir / ("sub" if i % 2 else "") / f"page{i:02d}.html").write_text(_page(i, topic), encoding="utf-8")
    (html_dir / "genindex.html").write_text(_page(99, "index entries"), encoding="utf-8")  # excluded by glob
    (txt_dir / "notes.txt").write_text(_prose(50, "notes") + "\r\n\r\n\r\n  trailing   \n", encoding="utf-8")
    (txt_dir / "readme.md").write_text("# Readme\n\n" + _prose(51, "readmes"), encoding="utf-8")
    dup = clean_text(html_to_text(_page(3, TOPICS[3]))).replace(FOOTER, "")  # page 3 once its footer is gone
    (txt_dir / "copy.txt").write_text(dup.upper(), encoding="utf-8")
    (txt_dir / "short.txt").write_text("Too short.", encoding="utf-8")
    (txt_dir / "other.txt").write_text("Это текст на другом языке, совсем не английский. " * 8, encoding="utf-8")
    (txt_dir / "numbers.txt").write_text(" ".join(str(n * 7919 % 10007) for n in range(300)), encoding="utf-8")
    (txt_dir / "image.png").write_bytes(b"\x89PNG not text")
    return html_dir, txt_dir


def _sources(fixture_dirs):
    html_dir, txt_dir = fixture_dirs
    return [directory_source("fixture:html", "BSD-3-Clause", html_dir, include=("**/*.html",),
                             exclude=("genindex*",)),
            directory_source("fixture:txt", "CC0-1.0", txt_dir)]


@pytest.fixture(scope="module")
def corpus(fixture_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    manifest = build_corpus(_sources(fixture_dirs), out, val_fraction=0.2, shard_bytes=2000)
    return out, manifest


def test_manifest_accounts_for_every_document(corpus):
    out, m = corpus
    assert load_manifest(out) == m
    html, txt = m["sources"]
    assert (html["name"], html["licence"], html["documents_read"], html["documents"]) == ("fixture:html",
                                                                                          "BSD-3-Clause", 12, 12)
    assert html["boilerplate_paragraphs_removed"] == 12  # the footer, once per page
    assert txt["documents_read"] == 6 and txt["documents"] == 2
    assert txt["dropped"] == {"duplicate": 1, "non_english": 1, "not_prose": 1, "short": 1}
    docs = {s: list(read_documents(out, s, verify=True)) for s in ("train", "val")}
    for e in m["sources"]:
        for split in ("train", "val"):
            mine = [d for d in docs[split] if d["source"] == e["name"]]
            assert len(mine) == e[f"{split}_documents"]
            assert sum(len(d["text"].encode()) for d in mine) == e[f"{split}_bytes"]
    assert m["totals"]["documents"] == 14 and html["val_documents"] >= 1
    assert len([s for s in m["shards"] if s["split"] == "train"]) > 1  # shard_bytes cut the split
    for s in m["shards"]:
        assert hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() == s["sha256"]


def test_cleaned_text(corpus):
    out, _ = corpus
    docs = {d["id"]: d["text"] for s in ("train", "val") for d in read_documents(out, s)}
    page = docs["fixture:html:page00.html"]
    assert page.startswith("Tables\n\nChapter 0 is about tables.")
    assert "- first & second\n" in page and "for x in tables:\n    print(x)" in page
    for gone in ("Sidebar", "previous", "noise", "color: red", "¶", FOOTER):
        assert gone not in page
    assert "fixture:html:sub/page01.html" in docs and not any("genindex" in k for k in docs)
    assert docs["fixture:txt:notes.txt"].endswith("running. The examples in chapter 50 use short names so that "
                                                  "each step stays easy to follow.\n\n  trailing")


def test_build_is_deterministic_and_guarded(corpus, fixture_dirs, tmp_path):
    out, m = corpus
    again = build_corpus(_sources(fixture_dirs), tmp_path / "c2", val_fraction=0.2, shard_bytes=2000)
    assert again == m
    for s in m["shards"]:
        assert (tmp_path / "c2" / s["file"]).read_bytes() == (out / s["file"]).read_bytes()
    with pytest.raises(ValueError, match="exists"):
        build_corpus(_sources(fixture_dirs), tmp_path / "c2")
    gpl = directory_source("gpl", "GPL-2.0-or-later", fixture_dirs[1])
    with pytest.raises(ValueError, match="not permissive"):
        build_corpus([gpl], tmp_path / "c3")
    (tmp_path / "c2" / m["shards"][0]["file"]).write_text("{}\n")
    with pytest.raises(ValueError, match="sha256"):
        list(read_documents(tmp_path / "c2", m["shards"][0]["split"], verify=True))


@pytest.mark.parametrize("expr, ok", [
    ("MIT", True), ("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0", True), ("Apache 2.0", True),
    ("Apache-2.0 WITH LLVM-exception AND BSD-2-Clause", True), ("GPL-2.0-only OR MIT", True),
    ("MIT AND GPL-2.0-only", False), ("MPL-2.0", False), ("GFDL-1.3-or-later", False), ("CC-BY-SA-4.0", False),
    ("(MIT OR GPL-3.0) AND LGPL-2.1", False), ("(MIT OR GPL-3.0) AND PostgreSQL", True), ("public-domain", True),
    ("UNKNOWN", False),
])
def test_licence_expressions(expr, ok):
    assert licence_is_permissive(expr) is ok


def test_text_helpers():
    assert html_to_text("<p>a &lt;b&gt;</p><pre>  x\n   y</pre>") == "\na <b>\n\n  x\n   y\n"
    assert clean_text("a  \r\n\r\n\r\n\n b\x00c\u200b") == "a\n\n bc"
    assert quality_reason("word " * 50) is None and quality_reason("word") == "short"
    src = 'def f():\n    """Doc of f."""\nclass C:\n    """Doc of C."""\n    def m(self):\n        """Doc of m."""\n'
    assert module_docstrings('"""Module doc."""\n' + src, "pkg.mod") == (
        "pkg.mod\n\nModule doc.\n\npkg.mod.f\n\nDoc of f.\n\npkg.mod.C\n\nDoc of C.\n\npkg.mod.C.m\n\nDoc of m.")
    assert module_docstrings("def broken(:\n", "x") == ""


def test_pypi_source_reads_an_installed_wheel():
    src = pypi_source("tiktoken")
    assert licence_is_permissive(src.licence) and src.version
    docs = list(src.documents())
    assert docs[0].key == "pypi:tiktoken:README" and any(d.key.endswith("core.py") for d in docs)
    with pytest.raises(ValueError, match="not installed"):
        pypi_source("surely-not-a-distribution-openk3")


def test_tokenizer_and_loader_on_the_built_corpus(corpus, tmp_path):
    out, m = corpus
    tok = train_tokenizer(out, 600, tmp_path / "tok")
    info = json.loads((tmp_path / "tok" / "tokenizer_training.json").read_text())
    assert info["training_bytes"] == m["totals"]["train_bytes"]
    assert info["manifest_sha256"] == hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    train = DocumentStore.from_corpus(out, tok, "train", cache_dir=tmp_path / "cache")
    assert len(train) == m["totals"]["train_documents"]
    assert len(list((tmp_path / "cache").iterdir())) == 1
    cached = DocumentStore.from_corpus(out, tok, "train", cache_dir=tmp_path / "cache")
    assert cached.fingerprint == train.fingerprint
    DocumentStore.from_corpus(out, tok, "train", cache_dir=tmp_path / "cache", add_eos=False)
    assert len(list((tmp_path / "cache").iterdir())) == 2  # another key, not a stale hit
    text = next(read_documents(out, "train"))["text"]
    assert tok.decode(train[0].ids[:-1].tolist()) == text and train[0].ids[-1] == tok.eos_id
    batch = next(PackedLoader(train, seq_len=64, batch_size=2, seed=0))
    assert batch.input_ids.shape == (2, 64) and int(batch.input_ids.max()) < tok.vocab_size


def test_cli_commands(fixture_dirs, tmp_path, capsys):
    from openk3.cli import main

    html_dir, _ = fixture_dirs
    out = tmp_path / "corpus"
    argv = ["build-corpus", "--no-debian", "--no-pypi", "--add-dir", f"fx:MIT:{html_dir}", "--out", str(out)]
    assert main(argv) == 0
    assert "13 documents" in capsys.readouterr().out  # the 12 pages + genindex (no exclude here)
    assert [s["name"] for s in load_manifest(out)["sources"]] == ["fx"]
    assert main(argv) == 2 and "exists" in capsys.readouterr().err
    assert main(["build-corpus", "--no-debian", "--no-pypi", "--add-dir", f"fx:GPL-3.0-only:{html_dir}",
                 "--out", str(tmp_path / "gpl")]) == 2
    assert "not permissive" in capsys.readouterr().err
    assert main(["train-tokenizer", "--corpus", str(out), "--vocab-size", "600", "--out", str(tmp_path / "t")]) == 0
    assert "<|end_of_msg|>=" in capsys.readouterr().out and (tmp_path / "t" / "tokenizer.json").is_file()
    assert main(["train-tokenizer", "--corpus", str(out), "--vocab-size", "100", "--out", str(tmp_path / "u")]) == 2
