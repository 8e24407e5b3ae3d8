"""The replay fast path (batched-step SDE replay) and its stock twin (the serial loop), DESIGN 1.1.

conditions  row payloads and the two CFG layouts        tiling    the seams that lay out the S*B batch
sde         Flow-GRPO / constant-std / multistep SDEs   segment   trajectory segment, targets, result
denoiser    adapter contract and the CFG combine        guards    when the fast path declines
rollout     sampling a segment, recording pi_old        replay    replay_serial, replay_batched, replay
spy         forward counters                            parity    stock vs fast judged, batch-shape floor
"""
