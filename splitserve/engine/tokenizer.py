"""Tokenizer loading (tokenizer.json + tokenizer_config.json on disk) and incremental decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitserve.engine.gguf_cache import resolve_checkpoint


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's fast tokenizer, chat template included; never touches a hub. A GGUF
    checkpoint's comes from its metadata (converted once: `gguf_cache`)."""
    root = resolve_checkpoint(model_dir)
    if not (root / "tokenizer.json").is_file():
        raise ValueError(f"{str(root)!r} has no tokenizer.json (a fast tokenizer is required)")
    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever emitting half a character.

    With a fast tokenizer this is the `tokenizers` library's own streaming decoder
    (`tokenizers.decoders.DecodeStream`), primed with the prompt's last tokens so that a first
    token's leading space comes out as it does in context. Otherwise (an older `tokenizers`),
    each step decodes a small window and emits what it adds beyond the window's previous text:

        tokens  ... [prefix_offset ........ read_offset) [new tokens ...]
                     `-- already emitted --'
    Either way the tail is held back while it is an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self._tokens: list[int] = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""
        self.num_fed = 0  # generated tokens fed so far
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = _decode_stream(self._tokens) if self._backend is not None else None
        self._held: list[int] = []  # fed to the stream, not yet turned into text

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new token ids; return the text they complete (possibly empty). `final` flushes
        a held-back incomplete character (as U+FFFD): nothing more will come."""
        self.num_fed += len(token_ids)
        if self._stream is not None:
            return self._add_streamed(token_ids, final)
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

    def _add_streamed(self, token_ids: list[int], final: bool) -> str:
        assert self._stream is not None
        pieces = []
        for token_id in token_ids:
            self._held.append(token_id)
            piece = self._stream.step(self._backend, token_id)
            if piece is not None:
                pieces.append(piece)
                self._held.clear()
        if final and self._held:
            pieces.append(self._decode(self._held))  # an incomplete character: U+FFFD
            self._held.clear()
        delta = "".join(pieces)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )


def _decode_stream(prompt_tail: list[int]) -> Any:
    """A `DecodeStream` primed with `prompt_tail`, or None where `tokenizers` has none."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - tokenizers < 0.21
        return None
    try:
        return DecodeStream(ids=prompt_tail, skip_special_tokens=True)
    except TypeError:  # pragma: no cover - a DecodeStream that can't be primed
        return None
