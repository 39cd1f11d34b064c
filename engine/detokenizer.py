"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, holding back an incomplete UTF-8 character.

    With a Rust (``tokenizers``) tokenizer, each new token is decoded once by the library's streaming
    decoder (``DecodeStream``), so a request's detokenization is linear in its length; the final text is
    one full decode, exactly what ``tokenizer.decode`` gives. Other tokenizers (or ones that clean up
    spaces after decoding) decode the whole output each time. Emitted text is never taken back.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: tuple[str, ...], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.text = ""
        self.stopped_by: str | None = None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None  # decode() post-processes the whole text: stream pieces would differ
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._streamed = ""  # the stream's text so far
        self._fed = 0  # tokens given to the stream

    def _decoded(self, token_ids: list[int], finished: bool) -> str:
        if self._stream is None or finished:
            full = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
            return full if finished else full.rstrip("\ufffd")  # wait for the rest of a character
        for t in token_ids[self._fed :]:
            piece = self._stream.step(self._backend, t)  # None until a whole character is there
            if piece:
                self._streamed += piece
        self._fed = len(token_ids)
        return self._streamed

    def update(self, token_ids: list[int], finished: bool) -> str:
        """Bring the text up to ``token_ids``; returns the new text. Sets ``stopped_by`` on a stop string."""
        if self.tokenizer is None or self.stopped_by is not None:
            return ""
        full = self._decoded(token_ids, finished)
        if not full.startswith(self.text):
            # A later token changed how earlier ones decode; never take back text already emitted.
            full = self.text + full[len(self.text) :]
        if self.stop:
            # A stop string never starts inside emitted text: the last max_len - 1 characters are held back.
            hits = [(i, s) for s in self.stop if (i := full.find(s, len(self.text))) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped_by = s
                full = full[: i + len(s)] if self.include_stop else full[:i]
            elif not finished:
                full = full[: max(len(self.text), len(full) - max(map(len, self.stop)) + 1)]
        delta = full[len(self.text) :]
        self.text = full
        return delta
