"""The `splitserve` command: one entry point for every service and tool of the project."""
