"""The decode worker: holds KV blocks pushed by prefill workers and runs the decode batch."""
