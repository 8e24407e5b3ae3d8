"""``--impl decode.minimax_h3=parity_adapters.decode:minimax_h3_decode``: all-gather only, no sliced batches."""

from __future__ import annotations

from flowstage.minimax_decode import SequenceParallelVAEDecoder

from harness.plugins.declarations import DecodeDeclaration


def minimax_h3_decode(vae, z, group, *, transport="all_gather", dst=0):
    if transport != "all_gather":
        raise NotImplementedError("flowstage's sequence-parallel decode all-gathers; it has no gather-to-one")
    return SequenceParallelVAEDecoder(vae, group).decode(z)


minimax_h3_decode.declares = DecodeDeclaration(vaes=("minimax_h3",), gather_to_one=False, slicing=False)
