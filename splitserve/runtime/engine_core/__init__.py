"""A worker's engine core in a process of its own, and the typed door the front process uses.

front process (gRPC, Redis, metrics, detokenization)      engine core process
EngineCoreClient ──commands (msgpack over ZMQ)──▶  CoreServer ─▶ EngineLoop (busy loop)
                 ◀──replies, one message per step──            KV connector, transports
"""
