"""Tensor parallelism: one engine over several processes (one per GPU), Megatron-style.

sharding.py (what each rank holds) · group.py (NCCL / gloo collectives) · layers.py (the
vocab-parallel embedding) · step_plan.py (rank 0's step inputs, broadcast) · launcher.py (rank
0: start, watch, stop the followers) · follower.py (a follower rank's loop).
"""
