"""Scheduling: execution route, liveness, offload, recompute, workspaces, plan."""
