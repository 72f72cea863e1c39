"""Large request bodies are checked in a separate process before the server parses them.

Parsing JSON (``json.loads``) is one C call that holds the GIL for its whole duration: tens of
MiB, or a million small values, freeze the event loop (``/health``, every other stream) for up to
seconds, and leave the server's heap grown afterwards. So a JSON-endpoint body of at least
:data:`SCREEN_BYTES` is first handed, as bytes, to a worker process (:class:`BodyScreen`) that
runs, in the server's order, the checks whose work grows with the body and that refuse it:

1. structure: at most ``Limits.max_json_values`` JSON values (array elements and object members,
   counted on the bytes before anything is built; :func:`json_values_exceed`) — exactly as many as
   a body just under :data:`SCREEN_BYTES` can hold, so no body under the threshold could exceed
   it either;
2. the JSON itself (the 400 FastAPI would give, same message);
3. the endpoint's first checks, as its route runs them: the model id (404), the parse into a
   request (the 400 naming the field), the message count and the size bound over every rendered
   field (:meth:`~openk3.server.serving.ChatServing.check_size`; history reasoning included when
   thinking is on), on every surface and the token-count endpoints (Anthropic and Responses:
   their ``parse_sized``);
4. the context in tokens, exactly (:meth:`~openk3.server.serving.ChatServing.check_tokens`): the
   request is rendered with the served tokenizer (loaded from ``ScreenSpec.tokenizer_dir``),
   whose text is encoded piece by piece and stopped at the first piece that reaches the context,
   so a body of tens of MiB costs about a context's worth of tokenizing, here, and a prompt that
   cannot fit is refused (the route's 400, Anthropic's wording on that surface) without the
   server tokenizing it.

A body the worker refuses is answered from its verdict and never parsed by the server; one it
accepts is parsed by the server as usual, at a cost bounded by those limits. The worker imports
no torch (a few tens of MB) and ignores SIGINT (a Ctrl-C on ``openk3 serve`` reaches the whole
process group; the server shuts the worker down itself). If the worker dies while checking a
body (say, killed for memory), that request is a 413 and a new worker is started. The worker is a
plain ``python -c`` subprocess speaking length-prefixed frames on its stdin / stdout (not
multiprocessing, which would re-import the parent's ``__main__``), driven by asyncio pipes, so
sending it 32 MiB never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import json
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import Any

from openk3.server.protocol import APIError

SCREEN_BYTES = (
    256 * 1024
)  # bodies at least this large are checked in the worker before the server parses them
MAX_JSON_VALUES = (
    SCREEN_BYTES + 1
) // 2  # as many values as SCREEN_BYTES - 1 bytes can hold ("[0,0,...,0]")

CHAT = "/v1/chat/completions"
COUNT = "/v1/tokenizers/estimate-token-count"
ANTHROPIC = "/anthropic/v1/messages"
ANTHROPIC_COUNT = "/anthropic/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
SCREENED = (CHAT, COUNT, ANTHROPIC, ANTHROPIC_COUNT, RESPONSES)

# a JSON string (skipped: commas and brackets inside it are text), a comma, or the opening of a
# non-empty array / object; the value count is 1 + the matches that are not strings
_TOKENS = re.compile(rb'"(?:[^"\\]++|\\.)*+"|,|[\[{](?![ \t\r\n]*[\]}])', re.DOTALL)


def json_values_exceed(raw: bytes, limit: int) -> bool:
    """Whether a JSON text holds more than `limit` values, decided on its bytes without decoding
    it. Values: 1 (the root) + the array elements + the object members (a key and its value
    count once), i.e. ``1 + commas + non-empty containers`` outside strings — exact for valid
    JSON; for invalid JSON some count the JSON parse then refuses anyway. A text of B bytes holds
    at most ``(B + 1) // 2`` values. Stops counting at ``limit + 1``; a text whose commas and
    brackets, strings included, are within the limit is not scanned at all.
    """
    if 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    count = 1
    if count > limit:
        return True
    for m in _TOKENS.finditer(raw):
        if raw[m.start()] != 0x22:  # not a string
            count += 1
            if count > limit:
                return True
    return False


def invalid_json_message(detail: str, pos: Any) -> str:
    """The 400 message for a body that is not JSON (FastAPI's ``json_invalid`` error, in the
    server's style): ``Invalid request: body: invalid JSON (Expecting value at character 0)``."""
    at = f" at character {pos}" if isinstance(pos, int) else ""
    return f"Invalid request: body: invalid JSON ({detail}{at})"


# A JSON integer longer than Python parses (``sys.get_int_max_str_digits()``, 4,300 by default):
# json.loads raises ValueError on it, before any field check could name it.
_LONG_INT = re.compile(
    rb'(?:"((?:[^"\\]|\\.)*)"\s*:\s*)?-?\d{%d,}' % (sys.get_int_max_str_digits() + 1)
)


def long_integer_message(raw: bytes) -> str:
    """The 400 message for a body holding an integer of more digits than Python parses, naming
    the object key it is the value of (``body`` when it is an array element):
    ``Invalid request: max_tokens: an integer of more than 4300 digits``."""
    m = _LONG_INT.search(raw)
    key = m.group(1).decode("utf-8", "replace") if m and m.group(1) is not None else "body"
    return f"Invalid request: {key}: an integer of more than {sys.get_int_max_str_digits()} digits"


def parsed_as_json(content_type: str | None) -> bool:
    """Whether FastAPI (strict content type, its default) parses a body with this
    ``Content-Type`` as JSON: ``application/json`` or ``application/*+json``, not a missing one."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


@dataclass(frozen=True)
class ScreenSpec:
    """What the worker needs to run the checks: the served model's id and context (tokens), the
    tokenizer's longest token (bytes; the size bound's unit) and the request limits."""

    model_id: str
    context_length: int
    max_token_bytes: int
    max_json_values: int = MAX_JSON_VALUES
    max_messages: int = 10_000  # Limits.max_messages of the server
    tokenizer_dir: str | None = (
        None  # the served tokenizer's files: the worker counts tokens with it
    )


_serving: Any = None
_spec: ScreenSpec | None = None


def _init_worker(spec: ScreenSpec) -> None:
    global _serving, _spec
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from openk3.server.serving import ChatServing, ModelInfo
    from openk3.server.validation import Limits

    _spec = spec
    tokenizer = None
    if spec.tokenizer_dir is not None:
        from openk3.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(spec.tokenizer_dir)
        except (
            OSError,
            ValueError,
        ) as e:  # the server loaded it; without it the worker bounds characters only
            print(
                f"openk3 serve: body screen: cannot load the tokenizer ({e}); bounding characters only",
                file=sys.stderr,
                flush=True,
            )
    _serving = ChatServing(
        None,
        tokenizer,
        ModelInfo(spec.model_id, spec.context_length),
        None,
        Limits(max_messages=spec.max_messages),
        max_token_bytes=spec.max_token_bytes,
    )


def _check(serving: Any, path: str, body: Any) -> None:
    """The endpoint's first checks, as its route runs them (model, parse, message count, size
    bound), then the context in tokens (``ChatServing.check_tokens``: the rendered text tokenized
    piece by piece, stopped as soon as it reaches the context); raises the route's APIError."""
    from openk3.server import anthropic

    counting = path in (COUNT, ANTHROPIC_COUNT)
    if path in (CHAT, COUNT):
        req = serving.parse(body, counting=counting)
        serving.check_size(req, counting=counting)
    elif path in (ANTHROPIC, ANTHROPIC_COUNT):
        req = anthropic.parse_sized(serving, body, counting=counting)
    elif path == RESPONSES:
        from openk3.server import responses

        req, _ = responses.parse_sized(serving, body)
    else:
        return
    try:
        serving.check_tokens(req, counting=counting)  # the context in tokens, counted only up to it
    except APIError as e:
        if path == ANTHROPIC:
            e.message = e.anthropic_message or e.message
        raise


def screen(
    path: str, raw: bytes, serving: Any = None, spec: ScreenSpec | None = None
) -> tuple | None:
    """The worker's verdict on one body: ``(status, message)`` to answer, or None to let the
    server parse and serve it. `serving` / `spec`: the worker's (set by its initializer) unless given.
    """
    serving, spec = serving or _serving, spec or _spec
    if json_values_exceed(raw, spec.max_json_values):
        return 400, (
            f"Invalid request: body: more than {spec.max_json_values} JSON values (array elements and "
            "object members), this server's limit"
        )
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        return 400, invalid_json_message(e.msg, e.pos)
    except RecursionError:
        return 400, "Invalid request: body: JSON nested too deeply to parse"
    except UnicodeDecodeError as e:
        return 400, invalid_json_message(str(e), None)
    except ValueError:  # an integer longer than Python parses
        return 400, long_integer_message(raw)
    try:
        _check(serving, path, body)
    except APIError as e:
        return e.status, e.message
    except (ValueError, TypeError, RecursionError, AttributeError, KeyError):
        return None  # what the server's own checks would raise differently: it answers it
    return None


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim(0)`` as a callable (a no-op where there is no glibc)."""
    import ctypes

    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: fn(0)


RETIRE_GROWTH = (
    32 * 2**20
)  # a worker whose resident set grew this much past its start exits after answering


def _rss_bytes() -> int:
    """This process's resident set (``VmRSS``), bytes; 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def worker_main(argv: list[str] | None = None) -> None:
    """The worker process: ``python -c 'from openk3.server.screen import worker_main; worker_main()'
    SPEC_JSON``. Reads requests ``!II`` (path length, body length) + path + body from stdin and
    answers each with one JSON line on stdout: ``null`` or ``[status, message]``; exits at EOF."""
    import struct
    import sys

    spec = ScreenSpec(**json.loads((argv or sys.argv[1:])[0]))
    _init_worker(spec)
    trim = _malloc_trim()
    trim()  # the baseline without what loading left freed (the tokenizer's parsed JSON)
    baseline = _rss_bytes()
    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        n_path, n_body = struct.unpack("!II", head)
        path = stdin.read(n_path).decode("utf-8", "replace")
        raw = stdin.read(n_body)
        try:
            verdict = screen(path, raw)
        except MemoryError:
            verdict = (
                413,
                "request body too large: the server could not check it within its memory",
            )
        del raw
        stdout.write(json.dumps(verdict).encode() + b"\n")
        stdout.flush()
        trim()  # hand the body's pages back: glibc keeps freed heap otherwise, and the worker lives long
        if _rss_bytes() > baseline + RETIRE_GROWTH:
            # what trim cannot give back (Python's object arenas after millions of values) goes
            # with the process: exit, and the server starts a fresh worker
            return


_TOO_LARGE = "request body too large: the server could not check it within its memory"


class BodyScreen:
    """The worker process that checks large bodies (module docstring); one per server, started on
    first use (or by :meth:`start`), requests to it serialised.

    Args:
        spec: :class:`ScreenSpec` of the served model.
        threshold: bodies of at least this many bytes are screened (:data:`SCREEN_BYTES`).
    """

    def __init__(self, spec: ScreenSpec, threshold: int = SCREEN_BYTES):
        self.spec = spec
        self.threshold = threshold
        self._proc: Any = None  # asyncio.subprocess.Process
        self._loop: Any = None  # the event loop its pipes belong to
        self._lock: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self) -> None:
        """Start the worker now (it takes a moment to import) rather than on the first large body."""
        loop = asyncio.get_running_loop()
        if (
            self._loop is not loop
        ):  # pipes and the lock belong to one loop (a test client may run several)
            self._kill(self._proc)
            self._loop, self._lock = loop, asyncio.Lock()
        if self._proc is not None and self._proc.returncode is None:
            return
        import dataclasses
        import sys

        code = "from openk3.server.screen import worker_main; worker_main()"
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            json.dumps(dataclasses.asdict(self.spec)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        with contextlib.suppress(
            Exception
        ):  # a 1 MiB pipe (Linux; 64 KiB default): fewer wake-ups per body
            import fcntl

            fcntl.fcntl(
                self._proc.stdin.get_extra_info("pipe").fileno(),
                getattr(fcntl, "F_SETPIPE_SZ", 1031),
                1 << 20,
            )

    def applies(self, path: str, content_type: str | None, size: int) -> bool:
        """Whether a body goes through the worker: a JSON endpoint, parsed as JSON, large."""
        return size >= self.threshold and path in SCREENED and parsed_as_json(content_type)

    async def check(self, path: str, chunks: list[bytes], size: int) -> APIError | None:
        """The worker's verdict on the body (`chunks`, `size` bytes in all, as received) as an
        :class:`APIError` to answer, or None.

        A worker found dead before it took the body is replaced and the body sent again; one that
        dies on the body (e.g. killed for memory) gives a 413 and is replaced on the next check; a
        check cancelled halfway (the client left) ends the worker the same way.
        """
        import struct

        await self.start()
        async with self._lock:
            for attempt in range(2):
                await self.start()
                proc = self._proc
                p = path.encode()
                try:
                    proc.stdin.write(struct.pack("!II", len(p), size) + p)
                    for chunk in chunks:  # the pipe's pace: never more than one chunk buffered here
                        proc.stdin.write(chunk)
                        await proc.stdin.drain()
                except (
                    BrokenPipeError,
                    ConnectionResetError,
                ):  # it was gone before it read this body
                    self._kill(proc)
                    if attempt == 0:
                        continue
                    return APIError(413, _TOO_LARGE)
                except BaseException:
                    self._kill(proc)
                    raise
                try:
                    line = await proc.stdout.readline()
                except BaseException:
                    self._kill(proc)
                    raise
                if not line:  # it died on this body
                    self._kill(proc)
                    return APIError(413, _TOO_LARGE)
                verdict = json.loads(line)
                if (
                    self._loop is not None
                ):  # a retiring worker exits after this answer: replace it now
                    asyncio.ensure_future(self._replace_if_exited(proc))
                return None if verdict is None else APIError(verdict[0], verdict[1])
        return APIError(413, _TOO_LARGE)

    async def _replace_if_exited(self, proc: Any) -> None:
        """If `proc` exits within 2 s of an answer (it retired: :data:`RETIRE_GROWTH`), reap it and
        start a fresh worker, so that the next large body does not wait for one to import."""
        try:
            await asyncio.wait_for(proc.wait(), 2)
        except asyncio.TimeoutError:
            return  # still serving
        except Exception:  # noqa: BLE001 - a worker gone some other way: the next check replaces it
            return
        if self._proc is proc:
            self._proc = None
            with contextlib.suppress(Exception):
                async with self._lock:
                    await self.start()

    def _kill(self, proc: Any) -> None:
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(proc.pid, signal.SIGKILL)
        if self._proc is proc:
            self._proc = None

    async def close(self) -> None:
        """Stop the worker (end of its input; killed if it does not exit within 5 s)."""
        proc = self._proc
        self._proc = None
        if proc is None or proc.returncode is not None:
            return
        if self._loop is not asyncio.get_running_loop():
            self._kill(proc)
            return
        with contextlib.suppress(Exception):
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except asyncio.TimeoutError:
            self._kill(proc)
            await proc.wait()
