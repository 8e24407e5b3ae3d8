"""Reported distributed-decode bugs re-created in ``sharded_decode(vae, z, group, *, transport='all_gather', dst=0)``
(``--impl decode=corpus.decode:NAME``).

Each callable is ``zoo_decode``'s right sharded decode with the one flaw its report describes (``REPORTS``).
Two reports concern a gather outside any VAE (a checkpoint planner, a tensor-parallel gather); the mistake,
a group rank where torch.distributed wants a global one, is the same in a decode that gathers to one rank.
"""

from __future__ import annotations

from dataclasses import replace

import zoo_decode
from zoo_decode import CORRECT

from corpus import Report

__all__ = ["REPORTS", "pytorch_dcp_group_rank_as_gather_dst", "vllm_omni_cosmos3_output_rank_only",
           "vllm_omni_h3_rank_without_tiles_raises", "vllm_tp_gather_group_rank_as_dst"]

REPORTS = {
    "pytorch_dcp_group_rank_as_gather_dst": Report(
        url="https://github.com/pytorch/pytorch/issues/141825",
        project="pytorch",
        version="2.5.1 (torch.distributed.checkpoint _DistWrapper)",
        mechanism=(
            "The checkpoint helper kept its coordinator as a rank within its process group and passed it as dst to "
            "dist.gather_object with that group. gather_object reads dst as a global rank, so for any group that "
            "does not start at global rank 0 the objects were sent to the wrong process, or to one outside the "
            "group."),
        recreation=("Under transport='gather' the group rank dst is passed to gather_object as is, not translated "
                    "with get_global_rank."),
        checks=("decode.t22.w4.subgroups_gather_dst1.bitexact",),
        flaws=replace(CORRECT, group_rank_dst=True)),
    "vllm_tp_gather_group_rank_as_dst": Report(
        url="https://github.com/vllm-project/vllm/pull/2528",
        project="vllm",
        version="main as of 2024-01 (tensor_model_parallel_gather)",
        mechanism=(
            "The tensor-parallel gather passed its destination to torch.distributed.gather as a rank within the "
            "tensor-parallel group. gather expects a global rank even when a group is given, so with pipeline "
            "parallelism (tensor-parallel groups that do not contain global rank 0) the gather targeted the wrong "
            "process."),
        recreation=("Under transport='gather' the group rank dst is passed to gather_object as is. The same flaw as "
                    "the pytorch report, so the two share one conformance run."),
        checks=("decode.t22.w4.subgroups_gather_dst1.bitexact",),
        flaws=replace(CORRECT, group_rank_dst=True)),
    "vllm_omni_h3_rank_without_tiles_raises": Report(
        url="https://github.com/vllm-project/vllm-omni/pull/6345",
        project="vllm-omni",
        version="main as of 2026-08 (MiniMax-H3 video VAE, vae_patch_parallel_size=4)",
        mechanism=(
            "The checkpoint's tiled decode dealt tiles to ranks round robin and raised on a rank whose share was "
            "empty. For small outputs there were fewer tiles than ranks: the ranks without tiles raised and left, "
            "while the ranks with tiles waited in the gather for them forever, so the stage hung instead of failing."),
        recreation=("Clips are dealt round robin and a rank dealt none raises before its first collective, leaving "
                    "the other ranks blocked in it."),
        checks=("decode.t12.w8.bitexact", "decode.t9.w8.bitexact"),
        flaws=replace(CORRECT, empty_share_raises=True)),
    "vllm_omni_cosmos3_output_rank_only": Report(
        url="https://github.com/vllm-project/vllm-omni/pull/6920",
        project="vllm-omni",
        version="0.28.0 (Cosmos3 multi-chunk transfer with distributed VAE)",
        mechanism=(
            "Distributed Wan VAE decode assembled the video only on rank 0 and handed the other ranks an empty "
            "tensor. The multi-chunk pipeline needs the trailing decoded frames on every rank to condition the next "
            "chunk, so the non-output ranks lost their conditioning."),
        recreation=("Under transport='all_gather', where every rank must return the video, only group rank 0 "
                    "assembles it and the others return an empty tensor."),
        checks=("decode.t22.w2.bitexact", "decode.t37.w8.bitexact"),
        flaws=replace(CORRECT, output_rank_only=True)),
}


_MADE = {name: report.recreate(zoo_decode._implementation) for name, report in REPORTS.items()}
pytorch_dcp_group_rank_as_gather_dst = _MADE["pytorch_dcp_group_rank_as_gather_dst"]
vllm_tp_gather_group_rank_as_dst = _MADE["vllm_tp_gather_group_rank_as_dst"]
vllm_omni_h3_rank_without_tiles_raises = _MADE["vllm_omni_h3_rank_without_tiles_raises"]
vllm_omni_cosmos3_output_rank_only = _MADE["vllm_omni_cosmos3_output_rank_only"]
