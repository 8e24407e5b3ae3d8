"""Processes: worlds of ranks (forked, spawned, or torchrun's), what a task carries to them, where each rank is,
and how a run stops. Nothing here knows what a check or a path is: tasks and their contexts are registered from
above."""
