"""The planner and role control: a `--role-switch` worker (`switchable.py` starts it,
`switchable_core.py` is its engine core, `handoff_core.py` the core's KV hand-off, `switch.py`
the change of role in its front), setting its role from outside (`control.py`), and the planner
that moves such workers to meet an SLO (`planner.py`, its decisions in `planner_policy.py`).
"""
