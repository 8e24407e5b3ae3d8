"""The ar fast path and its stock twin: B prompts right-padded (or left-padded) into one batch over a static KV
cache versus each prompt decoded alone at B=1 (docs/contracts.md, ar).

Modules: ``batch`` (right-padded batches, concat of separately embedded rows), ``cache`` (dynamic only at
B == 1; slot snapshots), ``masks`` (prefill key padding, per-row decode mask), ``backends`` (the HunyuanImage-3
upstream contract and transformers' hole layout), ``loop`` (init_state / step / finished rows, the fast and
the stock loop), ``left_padded`` (the other layout: left-padded batches, positions from the mask, the pads masked
at every step), ``replay`` (teacher-forced log-probs), ``spy``, ``probes`` (NaN and KV-footprint probes),
``policies`` (the stock floors and the tolerance policies on them), ``judge`` (rollouts to verdicts, the bf16 KL rule)
and ``comparisons`` (the runs behind every check: the batched path under a spy against its B=1 reference).
"""
