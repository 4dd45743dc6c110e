"""Runtime: target wrapper, draft trees, exact verification, drafters, the decode loop, CLI."""
