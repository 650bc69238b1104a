"""`splitserve bench serve`: a load generator for a running server, over splitserve's gRPC API or
any OpenAI-compatible HTTP endpoint, so that the same load measures splitserve and another
server alike.

The data flows one way: `datasets` makes the conversations, `schedule` their arrival times,
`load` sends them (from one or several client processes) through a `backends` sender and keeps
each request's timings, `metrics` turns the timings into figures, `report` prints, saves and
plots them. `splitserve/cli/bench.py` holds the flags.
"""
