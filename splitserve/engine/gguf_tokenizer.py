"""A GGUF file's tokenizer, built by transformers from the metadata `gguf_fields` already read.

`AutoTokenizer.from_pretrained(folder, gguf_file=…)` reads the file twice more: once with
`gguf.GGUFReader` for a model config (over ten seconds for Gemma 3's 262,144-token vocabulary,
spent only to learn the model type) and once for the tokenizer's own keys. What it then does with
those keys is small, and is done here on the keys we hold, with transformers' own pieces:

    metadata (as transformers' reader gives it) ──get_gguf_tokenizer's grouping──▶
        tokenizer dict, tokenizer_config ──convert_gguf_tokenizer──▶ backend tokenizer
    model type ──TOKENIZER_MAPPING──▶ tokenizer class ──from_pretrained(tokenizer_object=…)──▶

which is the same tokenizer (the same files saved; tests/engine/test_gguf_fields.py checks it
against `AutoTokenizer` itself). Where transformers lacks those pieces (older releases read
GGUF another way), or the GGUF's folder holds tokenizer files of its own that transformers
would mix in, `AutoTokenizer.from_pretrained(gguf_file=…)` builds it as before.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from splitserve.engine.gguf_archs import GGUFError
from splitserve.engine.gguf_fields import ARRAY, NUMERIC_TYPES, STRING, GGUFHeader

log = logging.getLogger(__name__)

# Words in the names of files transformers would read beside a GGUF file in its folder, and
# mix into the tokenizer (tokenizer.json, tokenizer_config.json, vocab.json, tekken.json, …).
_TOKENIZER_FILE_WORDS = ("tokenizer", "special_tokens", "added_tokens", "chat_template",
                         "tekken", "tiktoken", "vocab", "merges", "spiece")  # fmt: skip
# What transformers 5's `integrations.gguf.gguf_tokenizer_mapping` holds that we use or mirror
# (`_grouped` is its `get_gguf_tokenizer`, on metadata already read).
_PIECES = ("GGUF_TOKENIZER_MAPPING", "_SPECIAL_TOKENS", "get_gguf_tokenizer",
           "convert_gguf_tokenizer")  # fmt: skip
# The string arrays transformers' GGUF reader keeps whole (it counts the others).
_KEPT_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def build_tokenizer(header: GGUFHeader, model_type: str) -> Any:
    """transformers' tokenizer for the GGUF file `header` was read from (`model_type`: its HF
    config's), as `AutoTokenizer.from_pretrained(folder, gguf_file=…)` builds it."""
    source = header.path
    tokenizer = None
    if not _has_tokenizer_files(source.parent):
        try:
            tokenizer = tokenizer_from_fields(header, model_type)
        except (ImportError, AttributeError, TypeError, KeyError, ValueError) as exc:
            # NOTE: transformers' internals moved, or this file trips them: its own path decides
            log.info("%s: building the tokenizer by transformers' GGUF path: %r", source, exc)
    if tokenizer is None:
        from transformers import AutoTokenizer  # NOTE: here: this conversion loads torch

        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(source.parent), gguf_file=source.name, local_files_only=True
            )
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise GGUFError(f"{source.name}: its tokenizer could not be converted: {exc}") from None
    return tokenizer


def tokenizer_from_fields(header: GGUFHeader, model_type: str) -> Any | None:
    """The tokenizer from `header`'s fields through transformers' own GGUF pieces (transformers
    5's `integrations.gguf`), or None where this transformers has no such pieces or would not
    pick a tokens-backed class for `model_type`."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not all(hasattr(mapping, name) for name in _PIECES):
        return None
    tokenizer_class = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], TokenizersBackend)
    if not (isinstance(tokenizer_class, type) and issubclass(tokenizer_class, TokenizersBackend)):
        return None  # e.g. MistralCommonBackend: AutoTokenizer has its own rules there
    metadata = _as_transformers_reads(header)
    architecture, tokenizer_dict, tokenizer_config = _grouped(mapping, metadata)
    backend, extra_kwargs = mapping.convert_gguf_tokenizer(architecture, tokenizer_dict)
    # NOTE: what `gguf_file` does inside the class's __init__ (the backend in place of the
    # class's own, the config's keys, then the converter's, over its defaults) is what these
    # arguments do; the folder holds no tokenizer files (or we would not be here) to mix in.
    return tokenizer_class.from_pretrained(
        str(header.path.parent), tokenizer_object=backend, local_files_only=True,
        **{**tokenizer_config, **extra_kwargs},
    )  # fmt: skip


def _has_tokenizer_files(folder: Path) -> bool:
    return any(
        word in entry.name
        for entry in folder.iterdir()
        if entry.suffix.lower() != ".gguf"
        for word in _TOKENIZER_FILE_WORDS
    )


def _as_transformers_reads(header: GGUFHeader) -> dict[str, Any]:
    """The metadata as transformers' GGUF reader returns it when asked for the tokens and
    merges: every other string array as its length; an array of arrays it cannot read."""
    metadata = {}
    for key, value in header.fields.items():
        kind = header.types[key]
        if kind[0] == ARRAY and kind[1] not in NUMERIC_TYPES and kind[1] != STRING:
            raise ValueError(f"GGUF metadata {key} is an array of arrays")
        if kind == (ARRAY, STRING) and key not in _KEPT_STRING_ARRAYS:
            value = len(value)
        metadata[key] = value
    return metadata


def _grouped(mapping: Any, metadata: dict[str, Any]) -> tuple[str, dict, dict]:
    """`(architecture, tokenizer dict, tokenizer_config)`: transformers 5's
    `get_gguf_tokenizer`, on metadata already read."""
    architecture = metadata["general.architecture"]
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }  # fmt: skip
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":  # older files say nothing; llama.cpp adds BOS then
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":  # its chat template writes <bos> itself
        tokenizer_config["add_bos_token"] = False
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return architecture, tokenizer, tokenizer_config


def write_tokenizer(header: GGUFHeader, model_type: str, out_dir: Path) -> None:
    """Save the tokenizer as a fast tokenizer (tokenizer.json, its config, chat template)."""
    tokenizer = build_tokenizer(header, model_type)
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").is_file():
        raise GGUFError(f"{header.path.name}: its tokenizer has no fast (tokenizer.json) form")
