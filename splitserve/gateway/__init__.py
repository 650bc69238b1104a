"""The public gRPC API: validation, tokenization, routing, P->D orchestration, streaming."""
