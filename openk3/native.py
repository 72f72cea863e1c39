"""Build and load this package's small native CPU kernels (C source held as a string in each module).

A kernel is compiled once with the system C compiler (``$CC``, else ``cc``) into a cache directory
(``$OPENK3_KERNEL_CACHE``, else ``~/.cache/openk3``) under a name hashed from its source, compiler,
flags and machine, and loaded with ctypes; no torch headers, so a build takes about a second.
``OPENK3_NO_NATIVE=1`` disables every kernel: callers then run their PyTorch path (same results).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable

# Flag sets tried in order: without OpenMP a kernel is single-threaded but still correct.
FLAG_ATTEMPTS = (
    ["-O3", "-fPIC", "-shared", "-std=gnu99", "-fopenmp"],
    ["-O3", "-fPIC", "-shared", "-std=gnu99"],
)


def disabled() -> bool:
    """True when ``OPENK3_NO_NATIVE=1`` asks every caller to use its PyTorch path."""
    return os.environ.get("OPENK3_NO_NATIVE") == "1"


def cache_dir() -> str:
    """Where built libraries are kept (created on demand; the temp dir when that fails)."""
    d = os.environ.get("OPENK3_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "openk3"
    )
    try:
        os.makedirs(d, exist_ok=True)
        return d
    except OSError:
        return tempfile.gettempdir()


def build(stem: str, source: str, what: str) -> ctypes.CDLL:
    """Compile ``source`` (C99 + GNU extensions) into ``<cache>/<stem>_<hash>.so`` unless already
    there, and load it.

    Args:
        stem: file name prefix. source: the C code. what: the kernel's name for error messages.
    Raises:
        OSError: no flag set compiled (the compiler's messages included) or loading failed.
        subprocess.SubprocessError: the compiler could not be run.
    """
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256(
        (source + cc + repr(FLAG_ATTEMPTS) + os.uname().machine).encode()
    ).hexdigest()[:16]
    target = os.path.join(cache_dir(), f"{stem}_{tag}.so")
    if not os.path.isfile(target):
        errors = []
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.c")
            with open(src, "w", encoding="utf-8") as f:
                f.write(source)
            for flags in FLAG_ATTEMPTS:
                part = f"{target}.{os.getpid()}.tmp"
                r = subprocess.run(
                    [cc, *flags, src, "-o", part], check=False, capture_output=True, text=True
                )
                if r.returncode == 0:
                    os.replace(part, target)  # atomic: concurrent builders never see a partial file
                    break
                errors.append(r.stderr[-2000:])
                if os.path.exists(part):
                    os.remove(part)
            else:
                raise OSError(f"building the {what} failed:\n" + "\n".join(errors))
    return ctypes.CDLL(target)


class Kernel:
    """One native library, built and loaded on first use, once per process (thread-safe).

    Args:
        stem, source, what: as :func:`build`.
        setup: called with the loaded library to declare its functions' ``argtypes`` /
            ``restype``; returns why this CPU cannot use it (e.g. a missing SIMD level), or None.
    A failed build, ``OPENK3_NO_NATIVE=1`` or a ``setup`` refusal leaves :meth:`load` returning
    None and :meth:`unavailable_reason` saying why; callers then run their PyTorch path.
    """

    def __init__(
        self, stem: str, source: str, what: str, setup: Callable[[ctypes.CDLL], str | None]
    ):
        self.stem, self.source, self.what, self.setup = stem, source, what, setup
        self._lock = threading.Lock()
        self._tried = False
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, or None when it is unavailable (see :meth:`unavailable_reason`)."""
        with self._lock:
            if not self._tried:
                self._tried = True
                if disabled():
                    self._error = "disabled by OPENK3_NO_NATIVE=1"
                else:
                    try:
                        lib = build(self.stem, self.source, self.what)
                        self._error = self.setup(lib)
                        self._lib = lib if self._error is None else None
                    except (OSError, subprocess.SubprocessError) as exc:
                        self._error = str(exc)
        return self._lib

    def available(self) -> bool:
        """True when the library is built (or buildable now), loaded and usable on this CPU."""
        return self.load() is not None

    def unavailable_reason(self) -> str | None:
        """Why :meth:`available` is False (compiler error text, the CPU, the env switch); else None."""
        self.load()
        return self._error

    def require(self) -> ctypes.CDLL:
        """The loaded library. Raises RuntimeError naming the kernel and why it is unavailable."""
        lib = self.load()
        if lib is None:
            raise RuntimeError(f"{self.what} unavailable: {self._error}")
        return lib
