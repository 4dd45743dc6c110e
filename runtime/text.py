"""Tokens to text as a decode goes: incremental detokenisation and the one stop-string matcher.

Both cost per round what the round added, never the length of the answer so far: the decoder
re-decodes only a window of the last rounds' tokens, the matcher searches only the new text and
the few characters before it that could begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Text pushed piece by piece comes back up to the earliest stop string, which is never returned.

    Up to (longest stop string - 1) characters are held back while they could begin a stop string.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` (with what was held back) that is safe to show."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            self.stopped, out, self.pending = True, self.pending[: min(hits)], ""
            return out
        safe = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out

    def finish(self) -> str:
        """What was held back, once no more text will come."""
        out, self.pending = self.pending, ""
        return out


class TextDecoder:
    """Token ids pushed round by round come back as text deltas, cut before the first stop string.

    Each push decodes a window that starts at the previous push's tokens (so a tokenizer that drops a
    leading space, or merges bytes across tokens, decodes them in context) and returns what the new
    tokens add; while the text ends in an incomplete UTF-8 sequence the window grows and nothing is
    returned. `stopped` tells whether a stop string was met; `finish()` returns what is held back.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.matcher = StopMatcher(stop)
        self.window: list[int] = []  # ids of the last push (already shown) + ids not yet shown
        self.shown = 0  # how many ids at the start of `window` were already turned into text

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, tokens: list[int]) -> str:
        self.window += tokens
        before = self.tokenizer.decode(self.window[: self.shown], skip_special_tokens=True)
        text = self.tokenizer.decode(self.window, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
            return ""
        self.window, self.shown = self.window[self.shown :], len(self.window) - self.shown
        return self.matcher.push(text[len(before) :])

    def finish(self) -> str:
        """The text held back: a possible stop-string start, and an incomplete sequence as it decodes."""
        if self.stopped:
            return ""
        before = self.tokenizer.decode(self.window[: self.shown], skip_special_tokens=True)
        text = self.tokenizer.decode(self.window, skip_special_tokens=True)
        self.window, self.shown = [], 0
        return self.matcher.push(text[len(before) :]) + self.matcher.finish()

    def snapshot(self) -> TextDecoder:
        """A copy that can be pushed without touching this one."""
        copy = TextDecoder(self.tokenizer)
        copy.matcher.__dict__.update(self.matcher.__dict__, stop=list(self.matcher.stop))
        copy.window, copy.shown = list(self.window), self.shown
        return copy
