"""The prefill worker: chunked prefill, pushing each finished block's KV to a decode worker."""
