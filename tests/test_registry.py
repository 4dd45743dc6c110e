"""The drafter registry: one table of names, one spec parser, options that reach their drafter or are refused."""

from __future__ import annotations

import pytest

from headstart.runtime.drafters.options import EagleOptions, LookupOptions, MedusaOptions
from headstart.runtime.drafters.registry import DrafterSpec, make_drafter, names, option_names, parse_spec, resolve


def test_specs_parse_once_for_everyone():
    assert parse_spec("eagle+lookup:12") == DrafterSpec("eagle", graft="lookup", value=12)
    assert parse_spec("layerskip:8") == DrafterSpec("layerskip", value="8")
    assert parse_spec("model:runs/d") == DrafterSpec("model", value="runs/d")
    assert parse_spec("none").name == "none" and parse_spec("medusa+lookup").name == "medusa+lookup"
    for bad, why in [
        ("warp", "unknown drafter 'warp'"),
        ("lookup+lookup", "unknown"),
        ("none+lookup", "unknown"),
        ("lookup:3", "takes no ':' value"),
        ("eagle:x", "budget takes a number, got 'x'"),
        ("medusa:", "give a value"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_spec(bad)
    assert len(names()) == len(set(names())) and "eagle+lookup" in names() and "none+lookup" not in names()


def test_options_reach_their_drafter_or_are_named():
    lookup = make_drafter("lookup", budget=4)  # its branches grafted onto nothing, at most `budget` of them
    assert lookup.lookup.options == LookupOptions(budget=4) and lookup.budget == 4  # once dropped silently
    with pytest.raises(ValueError, match="the lookup drafter takes no option 'draft_vocab'"):
        make_drafter("lookup", draft_vocab=100)
    with pytest.raises(ValueError, match="takes no option 'budget'"):
        make_drafter("none", budget=4)
    grafted = resolve("eagle+lookup", max_ngram=4, graft_budget=3, budget=10)
    assert grafted["inner"] == EagleOptions(budget=10, sampled_budget=10)  # a budget set by hand holds at T > 0
    assert grafted["lookup"] == LookupOptions(max_ngram=4) and grafted["graft"].graft_budget == 3
    assert "graft_budget" in option_names("medusa+lookup") and "graft_budget" not in option_names("medusa")


def test_precedence_caller_then_spec_then_profile_then_default():
    assert resolve("medusa", "neutral")["inner"] == MedusaOptions()
    tuned = resolve("medusa", "smollm2-135m-cpu")["inner"]
    assert (tuned.budget, tuned.draft_vocab) == (7, 12288)
    assert resolve("medusa:16", "smollm2-135m-cpu")["inner"].budget == 16
    assert resolve("medusa:16", "smollm2-135m-cpu", budget=5)["inner"].budget == 5
    with pytest.raises(ValueError, match="unknown profile 'gpu'"):
        resolve("medusa", "gpu")
