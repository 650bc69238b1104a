"""splitserve: LLM serving with disaggregated prefill and decode. The layers (engine, kernels,
protos, kv_transfer, runtime, the services) and, above them, the app's rooms: `cli` (the
command line), `roles` (the planner and role control), `launch` (starting and wiring
processes) and `client` (docs/design.md, "Layout")."""
