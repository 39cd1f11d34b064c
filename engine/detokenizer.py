"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, holding back an incomplete UTF-8 character.

    The whole output is decoded each time (fast with the Rust tokenizers for a few hundred tokens), which
    keeps spacing rules exact; only the part after ``self.text`` is new.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: tuple[str, ...], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.text = ""
        self.stopped_by: str | None = None

    def update(self, token_ids: list[int], finished: bool) -> str:
        """Bring the text up to ``token_ids``; returns the new text. Sets ``stopped_by`` on a stop string."""
        if self.tokenizer is None or self.stopped_by is not None:
            return ""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd") and not finished:
            full = full.rstrip("\ufffd")  # wait for the rest of the character
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
