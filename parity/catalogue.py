"""The modules that register parity checks; parity/, mutation/ and gpu/ load them from here."""

from harness import checks

CHECK_MODULES = (
    "parity.replay_checks",
    "parity.ar_checks",
    "parity.decode_checks",
    "parity.attention_checks",
    "gpu.checks",
)


def load() -> None:
    checks.load_catalogue(CHECK_MODULES)
