"""Reading the small files of a checkpoint directory (configs, tokenizer files) defensively: only
regular files (not a FIFO, a device or a symlink to one: ``tokenizer.json`` linked to
``/dev/urandom`` would be read until memory runs out), only up to a size cap, and every failure a
``ValueError`` that names the file in one line."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MAX_CONFIG_BYTES = 16 * 2**20  # config.json, tokenizer_config.json, preprocessor_config.json
MAX_TOKENIZER_BYTES = 512 * 2**20  # tokenizer.json / tiktoken.model (the Kimi ranks file is 2.8 MB)


def check_regular(path: str | os.PathLike, max_bytes: int) -> int:
    """Size of ``path`` after checking it is a regular file (symlinks followed) of at most
    ``max_bytes``.

    Raises:
        ValueError: ``"<path>: cannot load: ..."`` for a missing file, a non-regular file or one
            over the cap.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"{os.fspath(path)}: cannot load: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{os.fspath(path)}: cannot load: not a regular file")
    if st.st_size > max_bytes:
        raise ValueError(
            f"{os.fspath(path)}: cannot load: {st.st_size} bytes is over the {max_bytes}-byte limit"
        )
    return st.st_size


def read_text(path: str | os.PathLike, max_bytes: int) -> str:
    """UTF-8 text of a regular file of at most ``max_bytes`` (see :func:`check_regular`).

    Raises:
        ValueError: naming the file (also for bytes that are not UTF-8, or a file that grew).
    """
    check_regular(path, max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{os.fspath(path)}: cannot load: {e.strerror}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{os.fspath(path)}: cannot load: over the {max_bytes}-byte limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{os.fspath(path)}: cannot load: not UTF-8 text (byte {e.start})"
        ) from None


def read_json(path: str | os.PathLike, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """JSON of a regular file of at most ``max_bytes``.

    Raises:
        ValueError: naming the file: unreadable, too large, not UTF-8, invalid or too deeply nested JSON.
    """
    text = read_text(path, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{os.fspath(path)}: cannot load: invalid JSON ({e.msg} at line {e.lineno} "
            f"column {e.colno})"
        ) from None
    except RecursionError:
        raise ValueError(f"{os.fspath(path)}: cannot load: JSON nested too deeply") from None
