"""The replay fast path (batched-step SDE replay) and its stock twin (the serial loop) (docs/contracts.md, replay).

conditions  row payloads, the CFG layouts, row broadcasting  tiling    the seams that lay out the S*B batch
sde         Flow-GRPO / constant-std / multistep SDEs        segment   trajectory segment, targets, result
denoiser    adapter contract and the CFG step                 cfg       the CFG combines a family chooses
families    shipped families (sd3, flux, qwen_image), lookups guards    when the fast path declines
rollout     sampling a segment, recording pi_old             replay    replay_serial, replay_batched, replay
problem     ReplayProblem, make_problem                      controls  the stock batch-shape control
policies    local-scale bounds built from the control        judge     stock vs fast judged, spies
spy         ReplayForwardSpy
"""
