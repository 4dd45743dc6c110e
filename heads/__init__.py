"""Draft-head modules (Medusa, EAGLE), their config and checkpoint format."""
