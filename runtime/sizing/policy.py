"""How rounds speculate, by name: the policy built here; the server's worker only runs it, and `headstart bench` and
`generate --speculation` run it in-process (a batch of one: `batch_of_one`).

    budget   each round, every request's tree sized by the load planner (`planner.py`) over the batched forward's
             measured cost (`batch_cost.py`): the batch-1 tree when the batch is empty, none when it fills the machine
    fixed    every request drafts its drafter's own tree, turned off by the switches: more than `speculate_up_to`
             requests decoding, more than `step_aside_queue` waiting, recent acceptance under `min_acceptance`
    off      plain decoding

The default everywhere (`headstart serve`, `bench`, `generate`): `budget`, `fixed` when a switch is given, `off` for
the drafter `none`. At a batch of one `budget` made what `fixed` makes (`headstart bench --speculation budget|fixed
--methods plain,eagle+suffix` on the first 8 held-out prompts, twice each, 2026-12-07: float32 1.84x / 1.67x plain
against 1.64x / 1.66x, bfloat16 1.31x / 1.45x against 1.33x / 1.28x; docs/serving.md), so bench and generate
default to it too. Imports no torch until a policy is built (the CLI checks a policy's name and switches
before it loads a model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headstart.runtime.drafters.base import Drafter
    from headstart.runtime.sizing.planner import Planner

POLICIES = ("budget", "fixed", "off")


@dataclass(frozen=True)
class Switches:
    """What turns a `fixed` policy's speculation off (None: never)."""

    speculate_up_to: int | None = None  # requests decoding at once up to which each drafts (0: never)
    step_aside_queue: int | None = None  # requests waiting beyond which every one decodes plainly
    min_acceptance: float | None = None  # recent tokens a round under which a request decodes plainly a while

    def given(self) -> list[str]:
        return [k for k, v in vars(self).items() if v is not None]


def policy_name(policy: str | None, switches: Switches, drafter: str) -> str:
    """The policy a server with the drafter named `drafter` runs: `policy` (checked against the switches), else the
    default (module docstring)."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"speculation policy {policy!r}: one of {', '.join(POLICIES)}")
    if policy in ("budget", "off") and switches.given():
        raise ValueError(f"the switches ({', '.join(switches.given())}) belong to the fixed policy, not {policy}")
    if policy is None:
        policy = "fixed" if switches.given() else "budget"
    return "off" if drafter == "none" else policy


def build_policy(
    policy: str,
    target,
    drafter: Drafter,
    switches: Switches,
    decoding: Callable[[], int],
    waiting: Callable[[], int],
    max_batch: int,
) -> tuple[Planner | None, Drafter]:
    """(the planner of the decode loop, or None; the drafter each request forks) for `policy` (`policy_name`'s) over
    the `target` and its `drafter`; `decoding` and `waiting` count the requests decoding and queued now."""
    from headstart.runtime.drafters.base import Drafter
    from headstart.runtime.paths import cache_dir
    from headstart.runtime.sizing.batch_cost import batch_cost
    from headstart.runtime.sizing.budgeted import Budgeted
    from headstart.runtime.sizing.gate import AcceptanceGate, GatedDrafter
    from headstart.runtime.sizing.planner import Planner

    if policy == "off":  # the drafter none as it is (it drafts nothing), another replaced by none
        return None, drafter if drafter.name == "none" else Drafter()
    if policy == "budget":
        return Planner(batch_cost(target, cache_dir() / "costs")), Budgeted(drafter)
    gate = AcceptanceGate(switches.min_acceptance) if switches.min_acceptance else None
    up_to = switches.speculate_up_to if switches.speculate_up_to is not None else max_batch
    aside = switches.step_aside_queue

    def speculate() -> bool:
        return decoding() <= up_to and (aside is None or waiting() <= aside)

    return None, GatedDrafter(drafter, speculate, gate)


def batch_of_one(policy: str | None, target, drafter: Drafter) -> tuple[Planner | None, Drafter]:
    """`build_policy` for one request at a time (`headstart bench`, `generate`): `policy` by name, None the default
    (`policy_name`)."""
    chosen = policy_name(policy, Switches(), drafter.name)
    return build_policy(chosen, target, drafter, Switches(), lambda: 1, lambda: 0, 1)
