"""Test helpers: tiny models, exactness checks, statistics, training set-ups, pinned losses."""
