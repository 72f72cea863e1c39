"""Offline corpus builder: permissively licensed English text found on this machine -> text shards.

Pipeline (:func:`build_corpus`), over :mod:`openk3.datasets.corpus_sources` sources: read -> clean
(:func:`clean_text`) -> drop paragraphs repeated across many documents of a source (navigation,
footers) -> quality filter (:func:`quality_reason`: length, English letters, prose share) -> exact
dedup across all sources -> per-source byte budget -> train/val split by a hash of the document key
(stable when sources are added or removed) -> JSONL shards + ``manifest.json`` with each source's
licence, origin, version and byte counts. Every choice is sorted or hashed, never random: the same
inputs give byte-identical shards. Read back with :func:`read_documents` / :func:`iter_texts`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk3.datasets.corpus_sources import (  # noqa: F401  (re-exported: one import for callers)
    DEBIAN_PACKAGES,
    DEBIAN_SOURCES,
    MB,
    PERMISSIVE_LICENCES,
    PYPI_DISTRIBUTIONS,
    Document,
    Source,
    debian_source,
    default_sources,
    directory_source,
    html_to_text,
    install_debian_packages,
    licence_is_permissive,
    module_docstrings,
    pypi_source,
)

__all__ = [
    "CORPUS_FORMAT",
    "DEBIAN_PACKAGES",
    "DEBIAN_SOURCES",
    "PERMISSIVE_LICENCES",
    "PYPI_DISTRIBUTIONS",
    "Document",
    "Source",
    "build_corpus",
    "clean_text",
    "debian_source",
    "default_sources",
    "directory_source",
    "html_to_text",
    "install_debian_packages",
    "iter_texts",
    "licence_is_permissive",
    "load_manifest",
    "module_docstrings",
    "pypi_source",
    "quality_reason",
    "read_documents",
    "cli_build_corpus",
]
CORPUS_FORMAT = "openk3-corpus/1"


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u200b\ufeff]")


def clean_text(text: str) -> str:
    """Normalise a document: NFC, ``\\r\\n`` -> ``\\n``, tabs kept, other control characters and
    zero-width marks dropped, trailing spaces stripped, lines of only spaces emptied, at most one
    blank line in a row, no leading/trailing blank lines."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text).replace("\u00a0", " ")
    lines = [ln.rstrip() for ln in text.split("\n")]
    out: list[str] = []
    for ln in lines:
        if ln or (out and out[-1]):
            out.append(ln)
    return "\n".join(out).strip("\n")


def quality_reason(
    text: str,
    *,
    min_chars: int = 200,
    min_ascii_letter_share: float = 0.9,
    min_letter_share: float = 0.4,
) -> str | None:
    """Why a cleaned document is dropped, or None to keep it.

    ``"short"``: fewer than `min_chars` characters. ``"not_prose"``: under `min_letter_share` of its
    non-space characters are letters (tables of numbers, code listings, data dumps).
    ``"non_english"``: under `min_ascii_letter_share` of its letters are ASCII (other scripts).
    """
    if len(text) < min_chars:
        return "short"
    letters = [c for c in text if c.isalpha()]
    nonspace = sum(1 for c in text if not c.isspace())
    if len(letters) < min_letter_share * max(nonspace, 1):
        return "not_prose"
    if sum(c.isascii() for c in letters) < min_ascii_letter_share * len(letters):
        return "non_english"
    return None


# ----------------------------------------------------------------------------------- building
def _norm_key(text: str) -> str:
    return hashlib.sha256(" ".join(text.split()).lower().encode()).hexdigest()


def _unit_hash(key: str) -> float:
    """A stable number in [0, 1) from a document key (split and budget order)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / float(1 << 48)


def _strip_boilerplate(
    docs: list[tuple[str, str, int]], min_docs: int, min_len: int = 40
) -> tuple[list[tuple[str, str, int]], int]:
    """Remove paragraphs of >= `min_len` chars found in >= `min_docs` documents of one source."""
    seen: Counter[str] = Counter()
    for _, text, _ in docs:
        seen.update({p.strip() for p in text.split("\n\n") if len(p.strip()) >= min_len})
    common = {p for p, n in seen.items() if n >= min_docs}
    if not common:
        return docs, 0
    removed = 0
    out = []
    for key, text, raw in docs:
        paras = text.split("\n\n")
        keep = [p for p in paras if p.strip() not in common]
        removed += len(paras) - len(keep)
        out.append((key, "\n\n".join(keep).strip("\n"), raw))
    return out, removed


@dataclass
class _SourceStats:
    documents_read: int = 0
    raw_bytes: int = 0
    dropped: Counter = field(default_factory=Counter)
    boilerplate_paragraphs_removed: int = 0


def build_corpus(
    sources: Iterable[Source],
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.01,
    shard_bytes: int = 16 * MB,
    min_chars: int = 200,
    boilerplate_min_docs: int = 8,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build a corpus directory: ``train-NNNNN.jsonl`` / ``val-NNNNN.jsonl`` shards (one JSON object
    per line: ``id``, ``source``, ``text``) and ``manifest.json``.

    Args:
        sources: the :class:`Source` s, in priority order (exact duplicates keep the first).
        out_dir: output directory (built in ``OUT.partial`` and renamed when complete).
        val_fraction: share of documents in the validation split, chosen by a hash of the key;
            every source with >= 10 documents gets at least one.
        shard_bytes: start a new shard past this many text bytes.
        min_chars: shorter cleaned documents are dropped (:func:`quality_reason`).
        boilerplate_min_docs: paragraphs (>= 40 chars) repeated in this many documents of one source
            are removed as navigation/footer boilerplate.
        overwrite: replace an existing `out_dir`.
        log: called with one progress line per source.
    Returns:
        The manifest dict (also written to ``manifest.json``).
    Raises:
        ValueError: a source licence that is not permissive, duplicate source names, bad
            `val_fraction` / `shard_bytes` / `min_chars`, or `out_dir` exists without `overwrite`.
    """
    sources = list(sources)
    out = Path(out_dir)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction: must be in [0, 1), got {val_fraction}")
    if shard_bytes <= 0 or min_chars < 0:
        raise ValueError(
            f"shard_bytes / min_chars: must be positive, got {shard_bytes} / {min_chars}"
        )
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"sources: duplicate names in {names}")
    for s in sources:
        if not licence_is_permissive(s.licence):
            raise ValueError(
                f"source {s.name!r}: licence {s.licence!r} is not permissive "
                f"(accepted: {', '.join(sorted(PERMISSIVE_LICENCES))})"
            )
    if out.exists() and not overwrite:
        raise ValueError(f"out_dir: {str(out)!r} exists; pass overwrite=True to replace it")

    seen_hashes: set[str] = set()
    kept: list[tuple[Source, list[tuple[str, str, int]], _SourceStats]] = []
    for src in sources:
        st = _SourceStats()
        docs: list[tuple[str, str, int]] = []
        for d in src.documents():
            st.documents_read += 1
            st.raw_bytes += d.raw_bytes
            docs.append((d.key, clean_text(d.text), d.raw_bytes))
        docs, st.boilerplate_paragraphs_removed = _strip_boilerplate(docs, boilerplate_min_docs)
        good = []
        for key, text, raw in docs:
            reason = quality_reason(text, min_chars=min_chars)
            h = _norm_key(text) if reason is None else ""
            if reason is None and h in seen_hashes:
                reason = "duplicate"
            if reason is not None:
                st.dropped[reason] += 1
                continue
            seen_hashes.add(h)
            good.append((key, text, raw))
        if src.max_bytes is not None and sum(len(t.encode()) for _, t, _ in good) > src.max_bytes:
            total = 0
            chosen = set()
            for key, text, _ in sorted(good, key=lambda d: _unit_hash(d[0])):
                n = len(text.encode())
                if total + n <= src.max_bytes:
                    chosen.add(key)
                    total += n
            st.dropped["over_budget"] += len(good) - len(chosen)
            good = [d for d in good if d[0] in chosen]
        kept.append((src, good, st))
        if log:
            log(
                f"{src.name}: {len(good)} documents, {sum(len(t.encode()) for _, t, _ in good):,} bytes "
                f"(read {st.documents_read}, dropped {dict(st.dropped)})"
            )

    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    writers: dict[str, dict[str, Any]] = {}
    shards: list[dict[str, Any]] = []

    def write(split: str, line: str, nbytes: int) -> None:
        w = writers.get(split)
        if w is None or w["bytes"] >= shard_bytes:
            if w is not None:
                w["fh"].close()
            name = f"{split}-{sum(s['split'] == split for s in shards):05d}.jsonl"
            w = writers[split] = {
                "fh": open(tmp / name, "w", encoding="utf-8", newline="\n"),
                "bytes": 0,
                "meta": {"file": name, "split": split, "documents": 0, "text_bytes": 0},
            }
            shards.append(w["meta"])
        w["fh"].write(line)
        w["bytes"] += nbytes
        w["meta"]["documents"] += 1
        w["meta"]["text_bytes"] += nbytes

    source_entries = []
    for src, good, st in kept:
        is_val = {key: _unit_hash("val:" + key) < val_fraction for key, _, _ in good}
        if val_fraction > 0 and len(good) >= 10 and not any(is_val.values()):
            is_val[min(is_val, key=lambda k: _unit_hash("val:" + k))] = True
        counts = {"train": [0, 0], "val": [0, 0]}
        for key, text, _ in good:
            split = "val" if is_val[key] else "train"
            n = len(text.encode())
            write(
                split,
                json.dumps({"id": key, "source": src.name, "text": text}, ensure_ascii=False)
                + "\n",
                n,
            )
            counts[split][0] += 1
            counts[split][1] += n
        source_entries.append(
            {
                "name": src.name,
                "licence": src.licence,
                "origin": src.origin,
                "version": src.version,
                "licence_evidence": src.licence_evidence,
                "documents_read": st.documents_read,
                "raw_bytes": st.raw_bytes,
                "documents": len(good),
                "text_bytes": counts["train"][1] + counts["val"][1],
                "train_documents": counts["train"][0],
                "train_bytes": counts["train"][1],
                "val_documents": counts["val"][0],
                "val_bytes": counts["val"][1],
                "dropped": dict(sorted(st.dropped.items())),
                "max_bytes": src.max_bytes,
                "boilerplate_paragraphs_removed": st.boilerplate_paragraphs_removed,
            }
        )
    for w in writers.values():
        w["fh"].close()
    for s in shards:
        s["sha256"] = hashlib.sha256((tmp / s["file"]).read_bytes()).hexdigest()
    manifest = {
        "format": CORPUS_FORMAT,
        "options": {
            "val_fraction": val_fraction,
            "shard_bytes": shard_bytes,
            "min_chars": min_chars,
            "boilerplate_min_docs": boilerplate_min_docs,
        },
        "sources": source_entries,
        "shards": shards,
        "totals": {
            k: sum(e[k] for e in source_entries)
            for k in (
                "documents",
                "text_bytes",
                "train_documents",
                "train_bytes",
                "val_documents",
                "val_bytes",
            )
        },
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return manifest


# ------------------------------------------------------------------------------------ reading
def load_manifest(corpus_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``manifest.json`` of a built corpus.

    Raises:
        ValueError: no manifest, invalid JSON, or another format.
    """
    f = Path(corpus_dir) / "manifest.json"
    if not f.is_file():
        raise ValueError(
            f"corpus_dir: {str(corpus_dir)!r} has no manifest.json (build it with `openk3 build-corpus`)"
        )
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: invalid JSON ({e})") from e
    if m.get("format") != CORPUS_FORMAT:
        raise ValueError(f"{f}: format {m.get('format')!r}, expected {CORPUS_FORMAT!r}")
    return m


def read_documents(
    corpus_dir: str | os.PathLike, split: str = "train", *, verify: bool = False
) -> Iterator[dict[str, str]]:
    """Documents (``{"id", "source", "text"}``) of one split, in shard order.

    Args:
        verify: check each shard's sha256 against the manifest first.
    Raises:
        ValueError: unknown `split`, missing manifest, or (with `verify`) a modified shard.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split: must be 'train' or 'val', got {split!r}")
    m = load_manifest(corpus_dir)
    for s in m["shards"]:
        if s["split"] != split:
            continue
        path = Path(corpus_dir) / s["file"]
        if verify and hashlib.sha256(path.read_bytes()).hexdigest() != s["sha256"]:
            raise ValueError(
                f"{path}: sha256 differs from the manifest (shard modified or truncated)"
            )
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)


def iter_texts(corpus_dir: str | os.PathLike, split: str = "train") -> Iterator[str]:
    """The texts of :func:`read_documents`."""
    for d in read_documents(corpus_dir, split):
        yield d["text"]


# ---------------------------------------------------------------------------------------- CLI
def cli_build_corpus(args: Any) -> int:
    """``openk3 build-corpus``: optional ``apt-get install``, then :func:`build_corpus` over
    :func:`default_sources` plus ``--add-dir NAME:LICENCE:PATH`` directories. Returns the exit code
    (2 with a message on stderr for bad input or a failed install)."""
    import sys

    try:
        if args.install and not args.no_debian:
            print(f"installing {' '.join(DEBIAN_PACKAGES)} ...", file=sys.stderr)
            install_debian_packages()
        sources = default_sources(debian=not args.no_debian, pypi=not args.no_pypi)
        for spec in args.add_dir:
            name, sep1, rest = spec.partition(":")
            licence, sep2, path = rest.partition(":")
            if not (sep1 and sep2 and name and licence and path):
                raise ValueError(f"--add-dir: expected NAME:LICENCE:PATH, got {spec!r}")
            sources.append(directory_source(name, licence, path))
        if not sources:
            raise ValueError(
                "no sources: install the Debian packages (--install) or drop --no-debian/--no-pypi"
            )
        manifest = build_corpus(
            sources,
            args.out,
            val_fraction=args.val_fraction,
            overwrite=args.overwrite,
            log=lambda line: print(line, file=sys.stderr),
        )
    except (ValueError, RuntimeError, OSError) as e:
        print(f"openk3 build-corpus: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        t = manifest["totals"]
        print(
            f"{args.out}: {t['documents']} documents, {t['text_bytes'] / MB:.1f} MiB of text "
            f"(train {t['train_bytes'] / MB:.1f} MiB, val {t['val_bytes'] / MB:.2f} MiB) from "
            f"{len(manifest['sources'])} sources"
        )
    return 0
