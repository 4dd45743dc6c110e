"""Training of draft heads on a frozen target: distillation, data and shards, the trainer's parts, evaluation.
The accelerate entry is train/heads.py; the losses live beside the heads (heads/losses.py)."""
