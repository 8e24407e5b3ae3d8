"""The modules that register ablations (after the checks they claim)."""

from harness import checks
from parity import catalogue as check_catalogue

ABLATION_MODULES = (
    "mutation.replay_ablations",
    "mutation.ar_ablations",
    "mutation.decode_ablations",
    "mutation.attention_ablations",
)


def load() -> None:
    check_catalogue.load()
    checks.load_catalogue(ABLATION_MODULES)
