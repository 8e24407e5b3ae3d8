"""What an implementation under test declares it drives and supports: one typed declaration per path.

Real code has its own shape: a framework's replay hook drives two families, keeps one guidance scale per rollout and
returns its means in the trajectory dtype; its decode only all-gathers. A callable says so with a declaration in its
``declares`` attribute::

    replay_batched.declares = ReplayDeclaration(families=("sd3",), guidance="scale", means_dtype="trajectory")

Each field names the values of one input axis (``harness.judging.space``) the implementation takes. A check whose
point lies on a subject (family, model, VAE) the implementation does not drive is outside the declaration: not
judged, and reported with the reason. A check that feeds an input class the declaration leaves out is still run,
under the guard contract: the implementation must refuse it (raise) or take the stock path (decline, or return the
stock answer), never return a different answer, so a declaration cannot hide a bug. Output dtypes are conventions:
an implementation that returns its means in the trajectory dtype is judged against the stock path rounded the same
way (``harness.replay.judge``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness.judging import space

__all__ = [
    "DECLARATIONS",
    "OUTPUT_DTYPES",
    "ARDeclaration",
    "AttentionDeclaration",
    "Declaration",
    "DecodeDeclaration",
    "ReplayDeclaration",
    "declared_by",
    "for_subject",
]

OUTPUT_DTYPES = ("float32", "trajectory")  # what a replay output comes back in: fp32, or the trajectory's dtype


def _axis_field(axis: str, default: Any = None) -> Any:
    """A field restricting ``axis``; whether that axis is the path's subject is the input space's to say."""
    return field(default=default, metadata={"axis": axis})


@dataclass(frozen=True)
class Declaration:
    """Base of the per-path declarations: every field that names an axis restricts that axis's values (None: every
    value); the subject field says which families, models or VAEs the implementation drives."""

    path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            if "axis" in item.metadata:
                value = getattr(self, item.name)
                if value is not None:
                    object.__setattr__(self, item.name, self._values(item.name, value))
        self._check_fields()

    def _values(self, name: str, value: Any) -> tuple[str, ...]:
        """A field's values as a tuple of strings, each one the axis admits (a subject's are checked later, against
        what the catalogue drives)."""
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{type(self).__name__}.{name}: expected a tuple of names, got {value!r}")
        values = tuple(value)
        if not values:
            raise ValueError(f"{type(self).__name__}.{name}: empty; leave it out (None) to take every value")
        axis = space.axis(self.path, self._axis_of(name))
        unknown = [v for v in values if not axis.admits(v)]
        if unknown:
            raise ValueError(f"{type(self).__name__}.{name}: unknown {axis.name} {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(axis.values)}")
        return values

    def _check_fields(self) -> None:
        """Fields that are not axes (output dtypes, a padding side): each subclass checks its own."""

    @classmethod
    def _axis_of(cls, name: str) -> str:
        return next(f.metadata["axis"] for f in dataclasses.fields(cls) if f.name == name)

    def supported(self) -> dict[str, tuple[str, ...]]:
        """Capability axis -> the values this implementation takes (only the axes it restricts)."""
        return {f.metadata["axis"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if "axis" in f.metadata and not self._is_subject(f) and getattr(self, f.name) is not None}

    @property
    def subject_field(self) -> str:
        return next(f.name for f in dataclasses.fields(self) if "axis" in f.metadata and self._is_subject(f))

    def _is_subject(self, item: dataclasses.Field) -> bool:
        return space.axis(self.path, item.metadata["axis"]).subject

    @property
    def subjects(self) -> tuple[str, ...] | None:
        """The families, models or VAEs driven; None: every one the catalogue has."""
        return getattr(self, self.subject_field)

    def outside(self, point: Mapping[str, str]) -> str | None:
        """Why a check at ``point`` is outside what this declaration drives, or None."""
        axis = space.subject_axis(self.path)
        value = point.get(axis.name) if axis is not None else None
        if self.subjects is None:
            return None
        if value is None:
            return f"the check drives no single {axis.name}, and the implementation declares {self._subjects_text()}"
        if value not in self.subjects:
            return f"it drives {axis.name} {value!r}; the implementation declares {self._subjects_text()}"
        return None

    def unsupported(self, point: Mapping[str, str]) -> list[str]:
        """The input classes of ``point`` this declaration leaves out: ``axis 'value' (declares: ...)``."""
        return [f"{axis} {point[axis]!r} (declares {', '.join(values)})" for axis, values in self.supported().items()
                if axis in point and point[axis] not in values]

    def _subjects_text(self) -> str:
        return f"{self.subject_field} {', '.join(self.subjects or ())}"

    def describe(self) -> str:
        """The declaration as written, its defaults left out."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(shown)})"

    def with_subject(self, subject: str) -> Declaration:
        """This declaration for an implementation given for one subject (``--impl replay.sd3=...``)."""
        subjects = self.subjects
        if subjects is not None and subject not in subjects:
            raise ValueError(f"given for {subject!r}, but it declares {self._subjects_text()}")
        return dataclasses.replace(self, **{self.subject_field: (subject,)})


@dataclass(frozen=True)
class ReplayDeclaration(Declaration):
    """A batched replay: the families it drives, the CFG layouts and combines it handles, whether it takes a per-step
    guidance schedule or one scale, and the dtype it returns each output in (``"trajectory"``: the segment's)."""

    path: ClassVar[str] = "replay"
    families: tuple[str, ...] | None = _axis_field("family")
    cfg_layouts: tuple[str, ...] | None = _axis_field("cfg_layout")
    combines: tuple[str, ...] | None = _axis_field("combine")
    guidance: str = "schedule"  # "schedule": a per-step sequence or one scale; "scale": one float only
    payloads: tuple[str, ...] | None = _axis_field("payload")
    log_probs_dtype: str = "float32"
    means_dtype: str = "float32"

    def _check_fields(self) -> None:
        if self.guidance not in ("schedule", "scale"):
            raise ValueError(f"ReplayDeclaration.guidance: unknown guidance {self.guidance!r}; known: 'schedule' "
                             "(a per-step sequence, or one scale), 'scale' (one float per rollout)")
        for name in ("log_probs_dtype", "means_dtype"):
            if getattr(self, name) not in OUTPUT_DTYPES:
                raise ValueError(f"ReplayDeclaration.{name}: unknown output dtype {getattr(self, name)!r}; known: "
                                 f"{', '.join(OUTPUT_DTYPES)}")

    def supported(self) -> dict[str, tuple[str, ...]]:
        found = super().supported()
        if self.guidance == "scale":
            found["guidance"] = ("scale",)
        return found

    def output_dtype(self, what: str) -> str:
        """``"float32"`` or ``"trajectory"`` for ``log_probs`` or ``prev_sample_means``."""
        return self.log_probs_dtype if what.startswith("log_probs") else self.means_dtype


@dataclass(frozen=True)
class ARDeclaration(Declaration):
    """A batched rollout: the models it drives and the side it pads (``harness.plugins.conformance.LAYOUTS``)."""

    path: ClassVar[str] = "ar"
    models: tuple[str, ...] | None = _axis_field("model")
    padding_side: str = "right"

    def _check_fields(self) -> None:
        if self.padding_side not in space.axis("ar", "padding_side").values:
            raise ValueError(f"ARDeclaration.padding_side: unknown padding side {self.padding_side!r}; known: "
                             "right, left")


@dataclass(frozen=True)
class DecodeDeclaration(Declaration):
    """A sharded decode: the VAEs it drives, whether it can gather to one rank and whether it honours the VAE's
    ``use_slicing``."""

    path: ClassVar[str] = "decode"
    vaes: tuple[str, ...] | None = _axis_field("vae")
    gather_to_one: bool = True
    slicing: bool = True

    def _check_fields(self) -> None:
        for name in ("gather_to_one", "slicing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DecodeDeclaration.{name}: expected True or False, got {getattr(self, name)!r}")

    def supported(self) -> dict[str, tuple[str, ...]]:
        found = super().supported()
        if not self.gather_to_one:
            found["transport"] = ("all_gather",)
        if not self.slicing:
            found["slicing"] = ("off",)
        return found


@dataclass(frozen=True)
class AttentionDeclaration(Declaration):
    """A kernel: the dtypes it computes in. Attention has no subject axis: every kernel check drives it."""

    path: ClassVar[str] = "attention"
    dtypes: tuple[str, ...] | None = _axis_field("dtype")

    @property
    def subject_field(self) -> str:
        return ""

    @property
    def subjects(self) -> tuple[str, ...] | None:
        return None

    def with_subject(self, subject: str) -> Declaration:
        raise ValueError("attention implementations are given path-wide (--impl attention=...): no family, model "
                         "or VAE selects them")


DECLARATIONS: dict[str, type[Declaration]] = {cls.path: cls for cls in (ReplayDeclaration, ARDeclaration,
                                                                        DecodeDeclaration, AttentionDeclaration)}


def declared_by(path: str, fn: Any) -> Declaration:
    """The declaration ``fn`` carries in ``declares`` (the path's default, every value, when it carries none); one
    of another path's type is a TypeError naming the expected type."""
    expected = DECLARATIONS[path]
    found = getattr(fn, "declares", None)
    if found is None:
        return expected()
    if not isinstance(found, expected):
        raise TypeError(f"declares = {found!r}: a {path} implementation declares a "
                        f"harness.plugins.declarations.{expected.__name__}")
    return found


def for_subject(path: str, fn: Any, subject: str | None) -> Declaration:
    """``fn``'s declaration as given: path-wide, or for one subject (``replay.sd3=...``)."""
    declared = declared_by(path, fn)
    return declared if subject is None else declared.with_subject(subject)
