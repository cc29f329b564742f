"""The text an OpenAI answer carries: streamed deltas with stop strings, and log-probabilities."""

from __future__ import annotations


class Stream:
    """One request's tokens as text deltas, with stop strings applied.

    Detokenized incrementally, as vLLM and TGI do: a new token decodes only the tokens since the
    last whole piece of text, with the few before them as context, so an answer of n tokens costs
    O(n) decoding, not O(n^2)."""

    def __init__(self, backend, stops: list[str]):
        self.backend, self.stops = backend, [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""        # the final text of tokens[:_read]
        self.sent = ""        # text already emitted (a prefix of ``text``)
        self.stopped = False
        self._prefix = self._read = 0  # tokens[_prefix:_read] decode to the tail of ``text``

    def _pending(self) -> str:
        """The text the tokens after ``_read`` add (possibly ending in half a character)."""
        before = self.backend.decode(self.tokens[self._prefix:self._read])
        return self.backend.decode(self.tokens[self._prefix:])[len(before):]

    def push(self, token: int) -> str:
        """The new text that ``token`` makes final (held back while a character or a possible stop
        string is incomplete)."""
        self.tokens.append(token)
        grown = len(self.text)
        new = self._pending()
        if new and not new.endswith("\ufffd"):
            self.text += new
            self._prefix, self._read = self._read, len(self.tokens)
        text = self.text
        for stop in self.stops:
            at = text.find(stop, max(0, grown - len(stop) + 1))
            if at >= 0:
                self.stopped = True
                text = text[:at]
                break
        if not self.stopped:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            for k in range(min(hold, len(text)), 0, -1):  # a tail that may begin a stop string
                if any(s.startswith(text[-k:]) for s in self.stops):
                    text = text[:-k]
                    break
        return self._emit(text)

    def flush(self) -> str:
        """The held-back text, once the request is over (no stop string matched)."""
        if self.stopped:
            return ""
        return self._emit(self.text + self._pending())

    def _emit(self, text: str) -> str:
        delta = text[len(self.sent):] if len(text) > len(self.sent) else ""
        self.sent += delta
        return delta


def _entry(backend, item, chat: bool) -> dict:
    token, lp, top = item
    text = backend.decode([token])
    if chat:
        return {"token": text, "logprob": lp, "bytes": list(text.encode()),
                "top_logprobs": [{"token": backend.decode([t]), "logprob": v, "bytes": list(backend.decode([t]).encode())}
                                 for t, v in top]}
    return {"token": text, "logprob": lp, "top": {backend.decode([t]): v for t, v in top}}


def logprob_payload(backend, r, chat: bool):
    if not r.token_logprobs:
        return None
    item = _entry(backend, r.token_logprobs[-1], chat)
    if chat:
        return {"content": [item]}
    return {"tokens": [item["token"]], "token_logprobs": [item["logprob"]], "top_logprobs": [item["top"]]}


def all_logprobs(backend, r, chat: bool):
    items = [_entry(backend, x, chat) for x in r.token_logprobs]
    if chat:
        return {"content": items}
    return {"tokens": [i["token"] for i in items], "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [i["top"] for i in items]}
