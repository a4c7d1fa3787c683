"""A completion's text as its tokens come (`Detokenizer`): what can be sent to a client now."""

from __future__ import annotations


class Detokenizer:
    """A completion's text as its tokens come, in O(1) decoding work per token (vLLM's incremental
    detokenizer): each new token is decoded with the few tokens before it (so a leading space, or a
    character split over tokens, decodes as in the whole text), and text grows only once a character
    is whole. End tokens are left out; the text is cut at the first stop string; text that a stop
    string may still change is held back until it cannot."""

    def __init__(self, tok, prompt, eos, stop: list[str]):
        self.tok, self.eos, self.stop = tok, set(eos), stop
        self.window = [int(t) for t in prompt[-4:]]  # tokens decoded together: [0, read) already text
        self.read = len(self.window)
        self.hold = max((len(x) - 1 for x in stop), default=0)
        self.tokens, self.all, self.sent, self.searched, self.stopped = [], "", "", 0, False

    def _grow(self, final: bool) -> None:
        """Append the text of the tokens past `read`, decoded after those before it; a character still
        unfinished waits (unless final, or 16 tokens wait: far more than a character has bytes)."""
        before = self.tok.decode(self.window[: self.read])
        now = self.tok.decode(self.window)
        if len(now) > len(before) and (final or not now.endswith("\ufffd") or len(self.window) - self.read > 16):
            self.all += now[len(before) :] if now.startswith(before) else self.tok.decode(self.window[self.read :])
            # the tokens just read become the context: they end on a character boundary
            self.window = self.window[self.read :]
            self.read = len(self.window)

    def _ready(self, final: bool) -> str:
        """The text that can be sent: cut at a stop string (searched from where it could begin)."""
        hits = [i for i in (self.all.find(x, max(0, self.searched - self.hold - 1)) for x in self.stop) if i >= 0]
        self.searched = len(self.all)
        if hits:
            self.stopped = True
            self.all = self.all[: min(hits)]
            return self.all
        return self.all if final else self.all[: max(0, len(self.all) - self.hold)]

    def _delta(self, ready: str) -> str:
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        delta, self.sent = ready[len(self.sent) :], ready
        return delta

    def add(self, token: int) -> tuple[str, bool]:
        """-> (text now final, whether a stop string ended the completion)."""
        self.tokens.append(int(token))
        if self.stopped or int(token) in self.eos:
            return "", self.stopped
        self.window.append(int(token))
        self._grow(final=False)
        return self._delta(self._ready(final=False)), self.stopped

    def flush(self) -> str:
        """The rest, once the completion has ended."""
        if not self.stopped:
            self._grow(final=True)
        return self._delta(self._ready(final=True))
