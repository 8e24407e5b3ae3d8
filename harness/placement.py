"""Where ranks and models go: the start method, --device-map, the torchrun group (joined at configure, left at
unconfigure), which rank reports, and the lines that say where things went."""

from __future__ import annotations

from typing import Any

import pytest

from harness.inputs import device_map as device_maps
from harness.options import gpu_device
from harness.process import launch, lifecycle

__all__ = ["configure_placement", "release_placement", "reporting_rank", "summarise_placement"]

def configure_placement(config: pytest.Config) -> None:
    """Where ranks and models go: PARITY_START_METHOD, --device-map, and the torchrun group when launched."""
    from harness.process.dist import resolve_start_method

    device = gpu_device(config)
    try:
        resolve_start_method(device.type)
        text = config.getoption("device_map")
        requested = device_maps.parse(text) if text is not None else None
        if requested is not None:  # a split naming GPUs this machine lacks cannot be honoured by any load
            device_maps.check_visible(requested)
        device_maps.configure(requested, device.type)
        if launch.launched() is not None:
            lifecycle.die_with_parent()  # a rank of torchrun's never outlives the launcher
            launch.join(device.type)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None


def reporting_rank() -> bool:
    """Under torchrun only rank 0 prints the table and writes the report; every rank does otherwise."""
    joined = launch.joined()
    return joined is None or joined.rank == 0


def release_placement() -> None:
    """Leave the torchrun group and forget --device-map (an in-process pytester run must not inherit either)."""
    launch.leave()
    device_maps.configure(None, "")


def summarise_placement(terminalreporter: Any) -> None:
    """Say how this run's ranks started and where device-mapped models went (the dry run's proof)."""
    joined = launch.joined()
    if joined is not None:
        terminalreporter.write_line(f"ranks: torchrun group of {joined.world_size} (this is rank {joined.rank})")
    for checkpoint, text, placed in device_maps.placements():
        devices = sorted(set(placed.values()))
        terminalreporter.write_line(f"device map {text}: {checkpoint} on {', '.join(devices)} "
                                    f"({len(placed)} placement entries)")
