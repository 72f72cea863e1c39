"""``AsyncEngine``: the :class:`~openk3.engine.engine.Engine` driven by one background thread, with
asyncio streaming for the server.

Only the engine thread touches the engine's state. A step whose work raises fails only the
requests in that work (``finish_reason="error"``, see :meth:`Engine.step`); an exception outside
that isolation fails every request in the engine (:meth:`Engine.fail_all`) and serving goes on;
only an unrecoverable state (or ``KeyboardInterrupt`` / ``SystemExit``) stops the thread, after
which :attr:`AsyncEngine.healthy` is False. Callers on any event loop enqueue commands
("add", "abort") under a lock; the thread drains them before every step, runs ``Engine.step()``
while work remains, and hands each :class:`~openk3.engine.engine.RequestOutput` to the
requesting loop with ``call_soon_threadsafe``. Validation (``Engine.check_request``) and the
queue bound run synchronously in ``generate`` so that bad input and overload surface as
``ValueError`` / ``EngineOverloaded`` on the first ``__anext__``, before anything is streamed.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator

from openk3.engine.engine import Engine, EngineOverloaded, RequestOutput
from openk3.engine.sampling import SamplingParams


class AsyncEngine:
    """Thread-backed async front of an :class:`Engine` (engine API contract).

    Args:
        engine: the engine; from now on only this object's thread may call it.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._cmds: deque = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_adds = 0
        self._closing = False
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        constraint=None,
        request_id: str | None = None,
        mm_inputs=None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes (``mm_inputs``: image inputs, see
        :meth:`Engine.add_request`).

        Raises (on the first ``__anext__``):
            ValueError: invalid request (``Engine.check_request``) or a duplicate request id.
            EngineOverloaded: the waiting queue is full.
            RuntimeError: the engine is shutting down, or its thread failed (the cause is chained).
        Leaving the iteration early (``break``, ``aclose()``, task cancellation on a client
        disconnect) aborts the request, which frees its slot and blocks at once.
        """
        if self._closing:
            raise RuntimeError("AsyncEngine: shutting down, not accepting requests")
        if self._error is not None:
            raise RuntimeError("AsyncEngine: the engine thread failed") from self._error
        params = params or SamplingParams()
        self.engine.check_request(prompt_ids, params, constraint, mm_inputs)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            if rid in self._streams:
                raise ValueError(f"request_id={rid!r}: already in use")
            waiting = len(self.engine.scheduler.waiting) + self._pending_adds
            if waiting >= self.engine.config.max_waiting:
                raise EngineOverloaded(
                    f"{waiting} requests waiting (max_waiting={self.engine.config.max_waiting})"
                )
            self._streams[rid] = (loop, queue)
            self._cmds.append(("add", rid, list(prompt_ids), params, constraint, mm_inputs))
            self._pending_adds += 1
            self._cond.notify()
        mm_inputs = None  # this frame lives as long as the stream: let the engine free the pixels after prefill
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(rid)
            with self._cond:
                self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; the engine frees it before its next step)."""
        with self._cond:
            self._cmds.append(("abort", request_id))
            self._cond.notify()

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting requests; with ``drain`` let running ones finish, else abort them; then
        stop the engine thread."""
        self._closing = True
        if not drain:
            with self._cond:
                self._cmds.append(("abort_all",))
                self._cond.notify()
        while self._thread.is_alive():
            with self._cond:
                idle = not self._cmds and not self.engine.has_unfinished()
                if idle or self._error is not None:
                    self._stop = True
                    self._cond.notify()
            if self._stop:
                break
            await asyncio.sleep(0.005)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, rid: str, item) -> None:
        with self._cond:
            target = self._streams.get(rid)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, constraint, mm_inputs = cmd
            with self._cond:
                self._pending_adds -= 1
            try:
                self.engine.add_request(
                    prompt, params, constraint, request_id=rid, mm_inputs=mm_inputs
                )
            except Exception as e:  # noqa: BLE001 - handed to the waiting consumer
                self._deliver(rid, e)
        elif kind == "abort":
            self.engine.abort(cmd[1])
        elif kind == "abort_all":
            self.engine.abort_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._cmds and not self._stop and not self.engine.has_unfinished():
                    self._cond.wait()
                if self._stop and not self._cmds:
                    return
                cmds = list(self._cmds)
                self._cmds.clear()
            try:
                for cmd in cmds:
                    self._apply(cmd)
                outputs = self.engine.step() if self.engine.has_unfinished() else []
            except Exception as e:  # noqa: BLE001 - outside the engine's own isolation: fail everything in it
                try:
                    outputs = self.engine.fail_all(e)
                except BaseException as e2:  # noqa: BLE001 - the state cannot be trusted any more
                    self._die(e2)
                    return
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt / SystemExit: stop serving
                self._die(e)
                return
            for out in outputs:
                self._deliver(out.request_id, out)

    def _die(self, e: BaseException) -> None:
        """The engine cannot serve any more: every consumer learns it, ``healthy`` turns False."""
        self._error = e
        with self._cond:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, RuntimeError(f"engine step failed: {e!r}"))

    @property
    def healthy(self) -> bool:
        """False once the engine thread has stopped on an unrecoverable error (or exited);
        a failed step that the engine isolated or recovered from (:meth:`Engine.step`,
        :meth:`Engine.fail_all`) leaves it True."""
        return self._error is None and (self._thread.is_alive() or self._stop)
