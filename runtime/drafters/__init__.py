"""Drafters: `base` (the interface), `registry` (every drafter by name), one module per method."""
