"""Training of draft heads on a frozen target: self-distillation, data, losses, the accelerate entry."""
