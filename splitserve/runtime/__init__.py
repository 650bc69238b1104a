"""The shared service runtime: settings, metrics, tracing, gRPC scaffolding, lifecycle.

Every service builds on it; it imports no service."""
