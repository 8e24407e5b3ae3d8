"""The structured sequence layout of HunyuanImage-3's DiT attention (docs/contracts.md, attention).

A sequence is ``text_len`` prompt tokens, an image span of ``image_len`` latents, and ``special_len``
special tokens. Prefill queries every position against every key. Denoise re-queries only the
special rows (the ``special_len`` positions just before the span) and the image span against the
cached keys ``[0, span end)``, so its query rows are bottom-right aligned with the keys: query row
``r`` sits at absolute position ``q_offset + r``.

A prompt may hold earlier images (conditioning images, as in image editing): ``images`` lists their
spans inside the text prefix, each bidirectional like the generated image's span. At prefill their rows
see their whole span; at denoise they lie in the cached prefix that every re-queried row sees anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PHASES", "SEED_DENOISE", "SEED_HEADS", "SEED_HEAD_DIM", "SEED_PREFILL", "SEED_SCALE", "AttentionLayout"]

Phase = Literal["prefill", "denoise"]
PHASES: tuple[Phase, ...] = ("prefill", "denoise")


@dataclass(frozen=True)
class AttentionLayout:
    """Text prefix, image span and special rows of one attention call; lengths derive from them."""

    text_len: int
    image_len: int
    special_len: int
    phase: Phase = "prefill"
    images: tuple[tuple[int, int], ...] = ()  # earlier image spans [start, end) inside the text prefix, in order

    def __post_init__(self) -> None:
        for name in ("text_len", "image_len", "special_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"AttentionLayout.{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"AttentionLayout.{name} must be >= 0, got {value}")
        if self.image_len < 1:
            raise ValueError(f"AttentionLayout.image_len must be >= 1 (the image span cannot be empty), "
                             f"got {self.image_len}")
        if self.phase not in PHASES:
            raise ValueError(f"AttentionLayout.phase must be one of {PHASES}, got {self.phase!r}")
        if self.phase == "denoise" and self.special_len > self.text_len:
            raise ValueError(f"denoise re-queries the {self.special_len} special rows just before the image span, "
                             f"so special_len must be <= text_len ({self.text_len})")
        self._check_images()

    def _check_images(self) -> None:
        if not isinstance(self.images, tuple):
            raise TypeError(f"AttentionLayout.images must be a tuple of (start, end) spans, got "
                            f"{type(self.images).__name__}")
        edge = 0
        limit = self.text_len - (self.special_len if self.phase == "denoise" else 0)
        for span in self.images:
            if (not isinstance(span, tuple) or len(span) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
                raise TypeError(f"AttentionLayout.images holds (start, end) int pairs, got {span!r}")
            start, end = span
            if start < edge or end - start < 2 or end > limit:
                raise ValueError(f"earlier image span {span} must hold >= 2 tokens, follow the previous one (from "
                                 f"{edge}) and end by {limit} (inside the text prefix, before the re-queried rows)")
            edge = end

    @property
    def span(self) -> tuple[int, int]:
        """The declared image span [start, end) in absolute positions."""
        return self.text_len, self.text_len + self.image_len

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Every bidirectional span in order: the earlier images, then the generated image's ``span``."""
        return (*self.images, self.span)

    @property
    def kv_len(self) -> int:
        """Keys: the whole sequence at prefill, the cached prefix up to the span end at denoise."""
        end = self.text_len + self.image_len
        return end + self.special_len if self.phase == "prefill" else end

    @property
    def q_len(self) -> int:
        return self.kv_len if self.phase == "prefill" else self.special_len + self.image_len

    @property
    def q_offset(self) -> int:
        """Absolute position of query row 0 (queries are bottom-right aligned with the keys)."""
        return self.kv_len - self.q_len

    @property
    def special_positions(self) -> tuple[int, int]:
        """[lo, hi) absolute positions of the special rows: trailing at prefill, leading the span at denoise."""
        start, end = self.span
        if self.phase == "prefill":
            return end, end + self.special_len
        return start - self.special_len, start

    def describe(self) -> str:
        start, end = self.span
        images = "".join(f", image [{a}, {b})" for a, b in self.images)
        return (f"{self.phase} {self.text_len} text + {self.image_len} image + {self.special_len} special: "
                f"Q {self.q_len} x KV {self.kv_len}, span [{start}, {end}){images}")


SEED_PREFILL = AttentionLayout(1249, 4096, 3, "prefill")
SEED_DENOISE = AttentionLayout(1249, 4096, 3, "denoise")
SEED_HEADS = 8  # rank 0 of a TP=4 run: 32 heads sharded 4 ways
SEED_HEAD_DIM = 128
SEED_SCALE = SEED_HEAD_DIM ** -0.5
