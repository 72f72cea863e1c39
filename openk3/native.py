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
