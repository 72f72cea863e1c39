"""Corpus sources: licence checks, HTML and docstring text extraction, and the source list.

A :class:`Source` is a named, licensed, ordered stream of raw :class:`Document` s. Kinds:

* **Debian documentation packages** (:func:`debian_source`), installed by name by
  :func:`install_debian_packages`; HTML manuals become plain text through :func:`html_to_text`.
* **PyPI distributions installed with openk3** (:func:`pypi_source`): the README from the wheel
  metadata and the docstrings of its Python modules (:func:`module_docstrings`).
* **Any directory** of ``.txt`` / ``.md`` / ``.rst`` / ``.html`` files (:func:`directory_source`).

Only permissive licences pass (:func:`licence_is_permissive` over :data:`PERMISSIVE_LICENCES`: MIT,
BSD, Apache, PSF, ISC, zlib, PostgreSQL, public domain, CC0, CC-BY). Copyleft (GPL, LGPL, MPL,
CC-BY-SA) and the GNU FDL (copyleft, with invariant sections) are refused, so that the corpus and
the models trained on it carry no conditions beyond attribution. ``DATA.md`` lists the default
sources (:data:`DEBIAN_SOURCES`, :data:`PYPI_DISTRIBUTIONS`) with their licences and sizes.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

# SPDX ids (and the few spellings package metadata uses instead) accepted as permissive.
PERMISSIVE_LICENCES = frozenset(
    {
        "MIT",
        "MIT-CMU",
        "X11",
        "BSD",
        "BSD-2-Clause",
        "BSD-3-Clause",
        "0BSD",
        "ISC",
        "Apache-2.0",
        "PSF-2.0",
        "Python-2.0",
        "CNRI-Python",
        "Zlib",
        "BSL-1.0",
        "PostgreSQL",
        "Unlicense",
        "CC0-1.0",
        "CC-BY-3.0",
        "CC-BY-4.0",
        "public-domain",
    }
)
_LICENCE_ALIASES = {
    "mit license": "MIT",
    "the mit license": "MIT",
    "bsd license": "BSD",
    "new bsd license": "BSD-3-Clause",
    "apache 2.0": "Apache-2.0",
    "apache-2": "Apache-2.0",
    "apache 2.0 license": "Apache-2.0",
    "apache software license": "Apache-2.0",
    "apache license 2.0": "Apache-2.0",
    "isc license": "ISC",
    "isc license (iscl)": "ISC",
    "python software foundation license": "PSF-2.0",
    "public domain": "public-domain",
    "mozilla public license 2.0 (mpl 2.0)": "MPL-2.0",
}


def _normalise_licence_id(s: str) -> str:
    s = s.strip()
    return _LICENCE_ALIASES.get(s.lower(), s)


def licence_is_permissive(expression: str) -> bool:
    """True when an SPDX-style licence expression only grants permissive terms.

    ``A AND B`` needs both permissive, ``A OR B`` either one, ``A WITH exc`` needs ``A`` (the
    exception only adds permissions). Parentheses are honoured.

    Raises:
        ValueError: `expression` is empty or not a string.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError(f"licence expression: must be a non-empty string, got {expression!r}")
    toks: list[str] = []
    for t in re.findall(r"\(|\)|[^\s()]+", expression):
        if (
            t in ("(", ")", "AND", "OR", "WITH")
            or not toks
            or toks[-1] in ("(", ")", "AND", "OR", "WITH")
        ):
            toks.append(t)
        else:  # "Apache 2.0", "BSD License": one id spelled in several words
            toks[-1] += " " + t
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def atom() -> bool:
        nonlocal pos
        t = peek()
        pos += 1
        if t == "(":
            v = disj()
            pos += 1  # ")"
        else:
            v = _normalise_licence_id(t or "") in PERMISSIVE_LICENCES
        if peek() == "WITH":
            pos += 2  # an exception only adds permissions
        return v

    def conj() -> bool:
        nonlocal pos
        v = atom()
        while peek() == "AND":
            pos += 1
            v = atom() and v
        return v

    def disj() -> bool:
        nonlocal pos
        v = conj()
        while peek() == "OR":
            pos += 1
            v = conj() or v
        return v

    return disj()


# ------------------------------------------------------------------------------- HTML to text
_SKIP_TAGS = {
    "script",
    "style",
    "head",
    "nav",
    "noscript",
    "svg",
    "form",
    "button",
    "footer",
    "template",
}
_VOID_TAGS = {
    "br",
    "hr",
    "img",
    "meta",
    "link",
    "input",
    "area",
    "base",
    "col",
    "embed",
    "source",
    "wbr",
}
_BLOCK_TAGS = {
    "p",
    "div",
    "br",
    "li",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "pre",
    "table",
    "tr",
    "dt",
    "dd",
    "blockquote",
    "section",
    "article",
    "ul",
    "ol",
    "dl",
    "hr",
    "caption",
    "figure",
    "main",
}
# Navigation and chrome of the Sphinx (Python, Django), DocBook (PostgreSQL) and SQLite page layouts.
_SKIP_CLASSES = {
    "sphinxsidebar",
    "related",
    "footer",
    "headerlink",
    "clearer",
    "mobile-nav",
    "menu-wrapper",
    "navheader",
    "navfooter",
    "nav",
    "inline-search",
    "version_switcher_placeholder",
    "language_switcher_placeholder",
    "fancy_toc",
    "fancy-toc1",
    "fancy-toc2",
    "nosearch",
    "menu",
    "sidebar",
    "toc",
    "breadcrumbs",
    "searchbox",
}
_SKIP_IDS = {
    "hd",
    "ft",
    "sidebar",
    "global-nav",
    "searchbox",
    "sidebarbutton",
    "toc",
    "breadcrumbs",
}
_SKIP_ROLES = {"navigation", "search"}


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # (tag, skipped): tolerates unclosed <p>/<li>
        self.out: list[str] = []
        self.pre = 0

    def _skipping(self) -> bool:
        return any(s for _, s in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: (v or "") for k, v in attrs}
        skip = (
            tag in _SKIP_TAGS
            or bool(_SKIP_CLASSES.intersection(a.get("class", "").split()))
            or a.get("id") in _SKIP_IDS
            or a.get("role") in _SKIP_ROLES
        )
        if tag in _BLOCK_TAGS and not self._skipping():
            self.out.append("\n" if tag != "li" else "\n- ")
        if tag in ("td", "th") and not self._skipping():
            self.out.append(" ")
        if tag == "pre":
            self.pre += 1
        if tag not in _VOID_TAGS:
            self.stack.append((tag, skip))

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if tag in _BLOCK_TAGS and not self._skipping():
            self.out.append("\n")

    def handle_data(self, data: str) -> None:
        if self._skipping():
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.out or self.out[-1].endswith("\n"):
                data = data.lstrip()  # indentation of the HTML source, not of the text
        if data:
            self.out.append(data)


def html_to_text(page: str) -> str:
    """Visible text of an HTML page: scripts, styles, navigation and sidebars dropped, block elements
    on their own lines, list items as ``- item``, ``<pre>`` whitespace kept, entities decoded.
    Result still needs :func:`clean_text`. Source: the HTML layouts of the packages in
    :data:`DEBIAN_SOURCES` (navigation classes in ``_SKIP_CLASSES``)."""
    p = _TextExtractor()
    p.feed(page)
    p.close()
    return "".join(p.out)


def module_docstrings(source: str, module: str) -> str:
    """The docstrings of a Python module as one document: the module docstring, then each class and
    function docstring under a ``qualified.name`` header line, in source order (``""`` when none or
    on a syntax error)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc and not child.name.startswith("_"):
                    parts.append(f"{name}\n\n{doc}")
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    doc = ast.get_docstring(tree, clean=True)
    if doc:
        parts.append(f"{module}\n\n{doc}")
    visit(tree, module)
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Document:
    """One raw document: ``key`` (unique within the build, e.g. ``source:path``), ``text`` (not yet
    cleaned) and ``raw_bytes`` (bytes read from disk, for the manifest)."""

    key: str
    text: str
    raw_bytes: int


@dataclass
class Source:
    """A licensed text source.

    Attributes:
        name: short id used in the manifest (``debian:sqlite3-doc``).
        licence: SPDX expression; must be permissive (:func:`licence_is_permissive`).
        origin: where it comes from, for people (package name and version, path).
        documents: zero-argument callable yielding :class:`Document` s in a fixed order.
        licence_evidence: file or metadata field the licence was read from.
        max_bytes: cleaned-text budget (None = all); over it, documents are kept in hash order.
        version: package version when known.
    """

    name: str
    licence: str
    origin: str
    documents: Callable[[], Iterable[Document]]
    licence_evidence: str = ""
    max_bytes: int | None = None
    version: str | None = None


def _read_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        import gzip

        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def directory_source(
    name: str,
    licence: str,
    root: str | os.PathLike,
    *,
    include: Iterable[str] = ("**/*",),
    exclude: Iterable[str] = (),
    origin: str | None = None,
    licence_evidence: str = "",
    max_bytes: int | None = None,
    version: str | None = None,
) -> Source:
    """Files under `root` matching `include` globs (minus `exclude`), sorted by path. ``.html`` /
    ``.htm`` go through :func:`html_to_text`; ``.txt``, ``.md``, ``.rst`` (optionally ``.gz``) are read
    as text; other suffixes are ignored.

    Raises:
        ValueError: `root` is not a directory (when the documents are read).
    """
    root = Path(root)
    exclude = tuple(exclude)
    include = tuple(include)

    def documents() -> Iterator[Document]:
        if not root.is_dir():
            raise ValueError(f"source {name!r}: root {str(root)!r} is not a directory")
        paths = sorted({p for g in include for p in root.glob(g) if p.is_file()})
        for p in paths:
            rel = p.relative_to(root).as_posix()
            if any(Path(rel).match(x) for x in exclude):
                continue
            base = p.name[:-3] if p.name.endswith(".gz") else p.name
            suffix = Path(base).suffix.lower()
            if suffix in (".html", ".htm"):
                text = html_to_text(_read_file(p))
            elif suffix in (".txt", ".md", ".rst", ".text"):
                text = _read_file(p)
            else:
                continue
            yield Document(f"{name}:{rel}", text, p.stat().st_size)

    return Source(
        name, licence, origin or str(root), documents, licence_evidence, max_bytes, version
    )


def _dpkg_version(package: str) -> str | None:
    try:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def debian_source(
    package: str,
    licence: str,
    root: str,
    *,
    include: Iterable[str],
    exclude: Iterable[str] = (),
    max_bytes: int | None = None,
) -> Source:
    """A Debian documentation package (installed by :func:`install_debian_packages`); its licence
    evidence is ``/usr/share/doc/PACKAGE/copyright``."""
    version = _dpkg_version(package)
    return directory_source(
        f"debian:{package}",
        licence,
        root,
        include=include,
        exclude=exclude,
        origin=f"Debian package {package} {version or '(not installed)'}",
        licence_evidence=f"/usr/share/doc/{package}/copyright",
        max_bytes=max_bytes,
        version=version,
    )


def distribution_licence(dist: Any) -> str:
    """The licence of an installed distribution (``importlib.metadata.Distribution``): its
    ``License-Expression``, else a short ``License`` field, else its ``License ::`` classifiers
    joined with AND; ``"UNKNOWN"`` when none say."""
    m = dist.metadata
    expr = m.get("License-Expression")
    if expr:
        return expr.strip()
    lic = (m.get("License") or "").strip()
    if lic and "\n" not in lic and len(lic) < 40:
        return _normalise_licence_id(lic)
    cls = [
        c.split("::")[-1].strip()
        for c in (m.get_all("Classifier") or [])
        if c.startswith("License ::")
    ]
    cls = [_normalise_licence_id(c) for c in cls if c not in ("OSI Approved", "DFSG approved")]
    if cls:
        return " AND ".join(sorted(set(cls)))
    if lic.lower().startswith("mit license"):
        return "MIT"
    return "UNKNOWN"


_SKIP_DIRS = frozenset(
    {
        "tests",
        "test",
        "testing",
        "_tests",
        "_vendor",
        "vendor",
        "vendored",
        "benchmarks",
        "examples",
    }
)  # test suites, benchmarks and third-party code inside wheels


def pypi_source(
    distribution: str, *, max_bytes: int | None = None, skip: Iterable[str] = ()
) -> Source:
    """An installed PyPI distribution: its README (wheel metadata description) and the docstrings of
    its ``.py`` files (directories named in ``_SKIP_DIRS`` skipped: tests, benchmarks, vendored
    third-party code; plus paths matching the `skip` globs).

    Raises:
        ValueError: the distribution is not installed.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(f"pypi_source: distribution {distribution!r} is not installed") from None
    licence = distribution_licence(dist)
    skip = tuple(skip)
    name = f"pypi:{dist.metadata['Name']}"

    def documents() -> Iterator[Document]:
        readme = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if readme.strip():
            yield Document(f"{name}:README", readme, len(readme.encode()))
        files = sorted(
            (f for f in (dist.files or []) if f.suffix == ".py"), key=lambda f: f.as_posix()
        )
        for f in files:
            rel = f.as_posix()
            if _SKIP_DIRS.intersection(f.parts[:-1]) or any(fnmatch.fnmatch(rel, g) for g in skip):
                continue
            path = Path(dist.locate_file(f))
            try:
                src = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            module = rel[:-3].replace("/", ".").removesuffix(".__init__")
            text = module_docstrings(src, module)
            if text:
                yield Document(f"{name}:{rel}", text, len(src.encode()))

    return Source(
        name,
        licence,
        f"PyPI distribution {dist.metadata['Name']} {dist.version} (installed)",
        documents,
        "wheel METADATA (License-Expression / License / classifiers)",
        max_bytes,
        dist.version,
    )


# ---------------------------------------------------------------------------- default sources
MB = 1 << 20
# (package apt installs, licence from /usr/share/doc/<doc package>/copyright, root glob, include,
# exclude, byte budget). The metapackages pull the release's versioned doc package (python3.11-doc
# and postgresql-doc-15 on Debian 12); the root glob finds it, and `dpkg-query -S` names it.
DEBIAN_SOURCES: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...], int], ...] = (
    (
        "python3-doc",
        "PSF-2.0",
        "/usr/share/doc/python3.*/html",
        ("**/*.html",),
        ("genindex*", "py-modindex.html", "search.html", "_*/*", "whatsnew/changelog.html"),
        14 * MB,
    ),
    (
        "python-django-doc",
        "BSD-3-Clause",
        "/usr/share/doc/python-django-doc/html",
        ("**/*.html",),
        ("genindex*", "py-modindex.html", "search.html", "_*/*", "releases/*"),
        10 * MB,
    ),
    (
        "postgresql-doc",
        "PostgreSQL",
        "/usr/share/doc/postgresql-doc-*/html",
        ("*.html",),
        ("bookindex.html", "release-*.html"),
        8 * MB,
    ),
    (
        "sqlite3-doc",
        "public-domain",
        "/usr/share/doc/sqlite3",
        ("*.html", "c3ref/*.html"),
        (
            "releaselog/*",
            "changes.html",
            "chronology.html",
            "doclist.html",
            "keyword_index.html",
            "sitemap.html",
            "toc.html",
        ),
        6 * MB,
    ),
)
DEBIAN_PACKAGES = tuple(s[0] for s in DEBIAN_SOURCES)
# Installed with openk3 or its test extras (torch pulls sympy, networkx, mpmath).
PYPI_DISTRIBUTIONS: tuple[tuple[str, int], ...] = (
    ("numpy", 3 * MB),
    ("torch", 3 * MB),
    ("sympy", 3 * MB),
    ("networkx", 2 * MB),
    ("mpmath", 1 * MB),
    ("transformers", 2 * MB),
    ("jinja2", MB),
    ("tokenizers", MB),
    ("safetensors", MB),
    ("tiktoken", MB),
)


def _version_key(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def _owning_package(path: str) -> str | None:
    try:
        r = subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None
    line = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    return line.split(":")[0].split(",")[0].strip() or None


def default_sources(*, debian: bool = True, pypi: bool = True) -> list[Source]:
    """The sources of the project corpus: :data:`DEBIAN_SOURCES` whose documentation is installed
    (the newest version when several match the root glob) and the :data:`PYPI_DISTRIBUTIONS`
    present in this environment. Missing ones are skipped; the manifest lists what was used."""
    import glob

    out = []
    for pkg, lic, root_glob, inc, exc, budget in DEBIAN_SOURCES if debian else ():
        roots = sorted((r for r in glob.glob(root_glob) if Path(r).is_dir()), key=_version_key)
        if roots:
            owner = _owning_package(roots[-1]) or pkg
            out.append(
                debian_source(owner, lic, roots[-1], include=inc, exclude=exc, max_bytes=budget)
            )
    for dist, budget in PYPI_DISTRIBUTIONS if pypi else ():
        try:
            out.append(pypi_source(dist, max_bytes=budget))
        except ValueError:
            continue
    return out


def install_debian_packages(packages: Iterable[str] = DEBIAN_PACKAGES) -> None:
    """``apt-get install --no-install-recommends`` the documentation packages (root required).

    Raises:
        RuntimeError: not root, apt-get missing, or the install failed (its output is in the message).
    """
    packages = list(packages)
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            "install_debian_packages: apt-get not found (a Debian/Ubuntu machine is needed)"
        )
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise RuntimeError(
            "install_debian_packages: must run as root; run `sudo apt-get install "
            + " ".join(packages)
            + "` yourself, then build without --install"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd[:2])} failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}"
            )
