"""Profiles: drafter options tuned for one model on one kind of machine, applied over the neutral defaults.

A profile maps a drafter name to option values (`headstart.runtime.drafters.options` holds every
option and its neutral default). The embedded model uses its own profile unless another is asked
for (`--profile`); every other model starts from the neutral defaults. How each value was chosen:
docs/tuning.md.
"""

from __future__ import annotations

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what other tools call it (an export's verifier)

PROFILES: dict[str, dict[str, dict[str, int | float]]] = {
    "neutral": {},
    # SmolLM2-135M-Instruct with its shipped heads, bfloat16 on a 2-core x86 CPU (docs/tuning.md).
    "smollm2-135m-cpu": {
        "medusa": {"budget": 7, "draft_vocab": 12288},
        "medusa2": {"budget": 7, "draft_vocab": 12288},  # medusa's, not re-tuned
        "eagle": {"budget": 12, "min_prob": 0.1, "sampled_budget": 8, "draft_vocab": 8192},
        "eagle3": {"budget": 12, "min_prob": 0.1, "sampled_budget": 8, "draft_vocab": 8192},  # eagle's, not re-tuned
    },
}


def default_profile(model_name: str | None) -> str:
    """The profile a model uses unless told otherwise."""
    return "smollm2-135m-cpu" if model_name == EMBEDDED_MODEL else "neutral"


def options(profile: str | None, drafter: str) -> dict[str, int | float]:
    """The option values `profile` sets for `drafter` (a registry name)."""
    if profile is None:
        return {}
    if profile not in PROFILES:
        raise ValueError(f"unknown profile '{profile}': choose from {', '.join(PROFILES)}")
    return PROFILES[profile].get(drafter, {})
