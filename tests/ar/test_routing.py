"""harness.ar.routing on stub MoE layers whose batch dependence is known exactly."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from harness.ar import routing

pytestmark = pytest.mark.cpu


class StubMoE(nn.Module):
    """Two experts; the output is the input scaled by a factor the forward's shape decides (``how``)."""

    def __init__(self, how: str, hidden: int = 8) -> None:
        super().__init__()
        self.how = how
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(2))
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape[:2]))
        if self.how == "lone":
            return x * (0.5 if x.shape[:2] == (1, 1) else 1.0)  # raw vs normalised weights
        if self.how == "rows":
            return x * (1.0 if x.shape[0] == 1 else 0.0)  # other rows take the capacity
        return x.clone(), torch.zeros(1)  # the output and router logits, as some MoEs return


class StubModel(nn.Module):
    def __init__(self, *layers: nn.Module, **config: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.config = SimpleNamespace(**config)


def test_bounds_and_moves_are_exact() -> None:
    assert routing.routing_bound(torch.float32) == 2.0**-10  # 8 fp32 eps would sit near GEMM rounding
    assert routing.routing_bound(torch.bfloat16) == 8 * 2.0**-7
    actual, reference = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 2.5], [3.0, 4.0]])
    assert routing._moves(actual, reference) == pytest.approx(0.2)  # over the larger magnitude, 2.5
    assert routing._moves(torch.zeros(1, 2), torch.zeros(1, 2)) == 0.0
    assert routing._moves(torch.tensor([[float("nan")]]), torch.tensor([[1.0]])) == float("inf")


def test_a_routing_that_ignores_the_batch_is_independent() -> None:
    layer = StubMoE("none")
    probe = routing.probe_routing(StubModel(layer, nn.Linear(8, 8)))
    assert (probe.layers, probe.dtype, probe.threshold) == (1, "float32", 2.0**-10)
    assert probe.independent and probe.cause() == "" and probe.lone_token == (0.0,) and probe.own_row == (0.0,)
    assert probe.describe().startswith("1 MoE layer(s) probed in float32"), probe.describe()  # the findings alone
    assert layer.shapes == [(4, 3), *[(1, 3)] * 4, *[(1, 1)] * 12]  # batched, each row, each token
    assert routing.probe_routing(StubModel(nn.Linear(8, 8))).describe().startswith("no MoE layer")


def test_a_lone_token_path_is_named() -> None:
    probe = routing.probe_routing(StubModel(StubMoE("none"), StubMoE("lone")))
    assert not probe.independent and probe.lone_token == (0.0, 0.5) and probe.own_row == (0.0, 0.0)
    assert probe.cause().startswith("single-token path") and probe.cause().endswith("layer 1")
    assert probe.describe().startswith("MoE routing depends on what shares the forward (single-token path")


def test_capacity_is_named_with_its_config_knobs() -> None:
    probe = routing.probe_routing(StubModel(StubMoE("rows"), moe_drop_tokens=True, capacity_factor=1.0))
    assert probe.own_row == (1.0,) and probe.lone_token == (1.0,)
    assert probe.knobs == {"moe_drop_tokens": True, "capacity_factor": 1.0}
    assert probe.cause() == ("expert capacity: a row's experts depend on the other rows of its batch, layer 0; "
                             "moe_drop_tokens=True, capacity_factor=1.0")
    unnamed = routing.probe_routing(StubModel(StubMoE("rows"), moe_drop_tokens=False, capacity_factor=1.0))
    assert unnamed.knobs == {"moe_drop_tokens": False} and "moe_drop_tokens=False" in unnamed.cause()


def test_a_move_exactly_at_the_bound_is_rounding_and_one_ulp_above_is_routing() -> None:
    """A token moved by more than the bound was routed differently; a move of exactly the bound was not."""
    bound = routing.routing_bound(torch.float32)
    at = routing.RoutingProbe(1, "float32", bound, lone_token=(bound,), own_row=(bound,))
    assert at.independent and at.cause() == ""
    above = math.nextafter(bound, math.inf)
    lone = routing.RoutingProbe(1, "float32", bound, lone_token=(above,), own_row=(bound,))
    assert not lone.independent and lone.cause().startswith("single-token path")
    rows = routing.RoutingProbe(1, "float32", bound, lone_token=(bound,), own_row=(above,))
    assert not rows.independent and rows.cause().startswith("expert capacity")


def test_a_model_without_moe_layers_names_no_cause() -> None:
    probe = routing.probe_routing(StubModel(nn.Linear(8, 8)))
    assert (probe.layers, probe.lone_token, probe.own_row) == (0, (), ())
    assert probe.independent and probe.cause() == ""


class RoutedAndZeroExperts(nn.Module):
    """One routed expert followed by a zero-compute (identity, weightless) expert, the order transformers 4.x's
    LongcatFlash lists them in; every token goes to the identity expert."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(hidden, hidden, bias=False), nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[1](x).clone()


def test_zero_compute_experts_do_not_hide_the_hidden_size() -> None:
    probe = routing.probe_routing(StubModel(RoutedAndZeroExperts()))
    assert (probe.layers, probe.lone_token, probe.own_row) == (1, (0.0,), (0.0,)) and probe.independent
