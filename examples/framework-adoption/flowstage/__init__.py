"""flowstage: a small RL trainer for image and video generators, written in the shape such frameworks have.

It is not part of fastpath-parity and imports nothing from it: per-model stages (``SD3DiffusionStage``,
``HunyuanImage3DiffusionStage``, ``HunyuanImage3ARStage``) over typed conditions, a runner that replays a stored
trajectory serially unless a stage's one-forward ``_replay_batched`` hook answers, a trajectory precision knob, one
guidance scale per rollout, and a video VAE decode sharded over a sequence-parallel group that only all-gathers.
``parity_adapters`` (beside this package) is the thin layer a team writes to put these stages under the suite's
``--impl``; docs/extending.md walks through it.
"""
