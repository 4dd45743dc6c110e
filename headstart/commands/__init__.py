"""The `headstart` subcommands, one module per group; each module's `add_parsers(sub)` registers its
subcommands with their handler (`run(args, argv) -> exit code`). headstart/cli.py composes them."""
