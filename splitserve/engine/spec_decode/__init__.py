"""Speculative decoding: proposers guess the next tokens, one target forward verifies them.

Kept free of imports here so that `EngineConfig` can read `spec_decode.config` without loading
torch-heavy modules; see docs/engine.md ("Speculative decoding").
"""
