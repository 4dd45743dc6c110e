"""Runtime: the target, draft trees, exact verification, drafters, the decode loop; the server, bench and demo
apps built on them (the `headstart` command itself lives in headstart/cli.py)."""
