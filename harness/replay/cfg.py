"""The CFG combine a replay family declares: how its pipeline turns the cond and uncond outputs into one.

A family states its pipeline's combine as a ``CfgCombine``: a formula over ``cond``, ``uncond`` and the guidance
scale ``g``, written as the pipeline writes it, and optionally a rescale to the cond branch's norm over the latent
channel dim. Any arithmetic of those three names parses (``+ - * /``, parentheses, numbers), so a combine the
suite has never met is declared, not asked for:

- ``STANDARD``: ``uncond + g * (cond - uncond)`` (SD3, Flux, Sana, CogView4, PixArt, HunyuanImage-3);
- ``COND_ANCHORED``: ``cond + g * (cond - uncond)``, anchored on the cond branch (ZImagePipeline: at g = 0 it is
  the cond prediction, where the standard combine gives the uncond one);
- ``TRUE_CFG_NORM_RESCALE``: the standard formula rescaled so each position keeps the cond prediction's norm over
  the channel dim (QwenImagePipeline's true CFG: ``comb * ||cond|| / ||comb||``; Lumina2Pipeline's
  ``cfg_normalization`` over its latent width).

Stock and batched replay both reach the family's combine through ``harness.replay.denoiser.combine_branches``, so
a combine bug hits both alike; the pipeline oracle and ``cfg2.pipeline_combine`` hold the declared combine to the
family's pipeline. ``rescale_to_cond_norm`` is a module-level function, a seam an ablation can replace.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["COMBINES", "COND_ANCHORED", "COND_NORM", "NAMES", "STANDARD", "TRUE_CFG_NORM_RESCALE", "CfgCombine",
           "combine", "rescale_to_cond_norm", "resolve"]

NAMES = ("cond", "uncond", "g")  # what a formula may read: the two branch outputs and the guidance scale
COND_NORM = "cond_norm"  # the one rescale a pipeline applies after its formula
RESCALES = (None, COND_NORM)
_OPERATORS: dict[type, Callable[[object, object], object]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b}
_UNARY: dict[type, Callable[[object], object]] = {ast.USub: lambda a: -a, ast.UAdd: lambda a: +a}

Evaluator = Callable[[dict[str, object]], object]


def _compile(node: ast.AST, formula: str) -> Evaluator:
    """An evaluator of one parsed node; anything but the arithmetic of ``NAMES`` and numbers is a ValueError."""
    if isinstance(node, ast.Expression):
        return _compile(node.body, formula)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        op, left, right = _OPERATORS[type(node.op)], _compile(node.left, formula), _compile(node.right, formula)
        return lambda names: op(left(names), right(names))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        unary, operand = _UNARY[type(node.op)], _compile(node.operand, formula)
        return lambda names: unary(operand(names))
    if isinstance(node, ast.Name) and node.id in NAMES:
        name = node.id
        return lambda names: names[name]
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = float(node.value)
        return lambda names: value
    raise ValueError(f"CFG combine {formula!r}: {ast.unparse(node)!r} is not arithmetic (+ - * /, parentheses, "
                     f"numbers) of {', '.join(NAMES)}")


@functools.cache
def _parsed(formula: str) -> tuple[Evaluator, frozenset[str]]:
    """The formula's evaluator and the names it reads (parsed once per formula)."""
    try:
        tree = ast.parse(formula.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"CFG combine {formula!r} does not parse as a formula ({err.msg}); write it as the "
                         "pipeline does, e.g. 'uncond + g * (cond - uncond)'") from None
    read = frozenset(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    return _compile(tree, formula), read


@dataclass(frozen=True)
class CfgCombine:
    """A family's CFG combine: ``formula`` over ``cond``, ``uncond`` and ``g`` (the pipeline's own expression),
    then ``rescale``: None, or ``"cond_norm"`` (each position rescaled to the cond output's norm over the
    adapter's ``channel_dim``). ``name`` is a short handle for reports; the formula is what reports print."""

    formula: str
    name: str = ""
    rescale: str | None = None

    def __post_init__(self) -> None:
        _, read = _parsed(self.formula)
        missing = [name for name in NAMES if name not in read]
        if missing:
            raise ValueError(f"CFG combine {self.formula!r} never reads {', '.join(missing)}: a combine of two CFG "
                             "branches reads cond, uncond and the guidance scale g")
        if self.rescale not in RESCALES:
            raise ValueError(f"CFG combine {self.formula!r}: rescale must be one of {RESCALES}, got {self.rescale!r}")

    def __str__(self) -> str:
        rescaled = ", rescaled to ||cond|| over the channel dim" if self.rescale == COND_NORM else ""
        return f"{self.name + ': ' if self.name else ''}{self.formula}{rescaled}"

    def apply(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float, channel_dim: int) -> torch.Tensor:
        """The formula at scale ``scale``, then the rescale over ``channel_dim``."""
        evaluate, _ = _parsed(self.formula)
        combined = evaluate({"cond": cond, "uncond": uncond, "g": float(scale)})
        if not isinstance(combined, torch.Tensor):  # pragma: no cover - every formula reads both branches
            raise TypeError(f"CFG combine {self.formula!r} gave {type(combined).__name__}, not a tensor")
        if self.rescale == COND_NORM:
            return rescale_to_cond_norm(combined, cond, channel_dim)
        return combined


STANDARD = CfgCombine("uncond + g * (cond - uncond)", "standard")
COND_ANCHORED = CfgCombine("cond + g * (cond - uncond)", "cond_anchored")
TRUE_CFG_NORM_RESCALE = CfgCombine("uncond + g * (cond - uncond)", "true_cfg_norm_rescale", rescale=COND_NORM)
COMBINES = {known.name: known for known in (STANDARD, COND_ANCHORED, TRUE_CFG_NORM_RESCALE)}


def rescale_to_cond_norm(combined: torch.Tensor, cond: torch.Tensor, dim: int) -> torch.Tensor:
    """``combined * ||cond|| / ||combined||``, the norms over ``dim`` (the channels), kept per position."""
    cond_norm = torch.linalg.vector_norm(cond, dim=dim, keepdim=True)
    combined_norm = torch.linalg.vector_norm(combined, dim=dim, keepdim=True)
    return combined * (cond_norm / combined_norm)


def resolve(declared: CfgCombine | str) -> CfgCombine:
    """A declared combine as a ``CfgCombine``: one itself, or the name of a known one (``COMBINES``)."""
    if isinstance(declared, CfgCombine):
        return declared
    if isinstance(declared, str) and declared in COMBINES:
        return COMBINES[declared]
    raise ValueError(f"unknown CFG combine {declared!r}; known: {', '.join(COMBINES)}, or declare the pipeline's own "
                     "as CfgCombine('<formula over cond, uncond and g>')")


def combine(kind: CfgCombine | str, cond: torch.Tensor, uncond: torch.Tensor, scale: float, *,
            channel_dim: int) -> torch.Tensor:
    """The declared combine ``kind`` of two branch outputs of one shape."""
    if cond.shape != uncond.shape:
        raise ValueError(f"CFG combine: cond {tuple(cond.shape)} and uncond {tuple(uncond.shape)} differ in shape")
    return resolve(kind).apply(cond, uncond, scale, channel_dim)
