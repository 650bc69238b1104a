"""Moving KV blocks between workers and the Redis block-ownership registry."""
