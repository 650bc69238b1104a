"""Test fixtures: tiny random-weight checkpoints and tokenizers, built locally (tests and
`splitserve make-tiny-model`)."""
