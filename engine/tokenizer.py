"""Tokenizer loading (tokenizer.json + tokenizer_config.json on disk) and incremental decoding."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's fast tokenizer, chat template included; never touches a hub."""
    root = Path(model_dir)
    if not (root / "tokenizer.json").is_file():
        raise ValueError(f"{str(root)!r} has no tokenizer.json (a fast tokenizer is required)")
    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever emitting half a character.

    Decoding one token at a time breaks byte-level BPE (a character may span tokens) and drops
    the leading spaces some tokenizers add only in context, so each step decodes a small window
    and emits what it adds beyond the window's previous text:

        tokens  ... [prefix_offset ........ read_offset) [new tokens ...]
                     `-- already emitted --'
    The tail is held back while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self._tokens: list[int] = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""
        self.num_fed = 0  # generated tokens fed so far

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new token ids; return the text they complete (possibly empty). `final` flushes
        a held-back incomplete character (as U+FFFD): nothing more will come."""
        self.num_fed += len(token_ids)
        self._tokens.extend(token_ids)
        decode = self._decode
        prefix_text = decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = decode(self._tokens[self._prefix_offset :])
        if (full_text.endswith("\ufffd") and not final) or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )
