"""The architectures the tiny random-weight checkpoints come in: a module of its own, so that the
command line can offer them (`make-tiny-model --arch`) without loading torch."""

SUPPORTED_TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
