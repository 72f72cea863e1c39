"""Stop strings over streamed text (api.md §1.1 ``stop``): the text from the earliest match on is
never sent, and text that could still become a match is held back until it cannot."""

from __future__ import annotations


class StopFilter:
    """Cuts one text field at the earliest-starting stop string, however the text is split.

    ``feed(text) -> (safe_text, matched_stop_or_None)``; ``flush() -> (text, matched_or_None)`` at
    the end of the field. Text that could still start a stop is held back; a match is reported only
    once no stop starting earlier can still complete (stops ``["a", "baa"]`` over ``"ba" + "a"``
    cut at 0, not at 1).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.buf = ""

    def _open_start(self) -> int:
        """Earliest position whose suffix is a proper prefix of some stop (len(buf) if none)."""
        buf = self.buf
        longest = max((len(s) for s in self.stops), default=1)
        for q in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[q:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return q
        return len(buf)

    def _scan(self, final: bool) -> tuple[str, str | None]:
        hit = min(((self.buf.find(s), s) for s in self.stops if s in self.buf), default=None)
        pending = len(self.buf) if final else self._open_start()
        if hit is not None and hit[0] <= pending:
            out = self.buf[: hit[0]]
            self.buf = ""
            return out, hit[1]
        out, self.buf = self.buf[:pending], self.buf[pending:]
        return out, None

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        self.buf += text
        return self._scan(final=False)

    def flush(self) -> tuple[str, str | None]:
        return self._scan(final=True)
