"""Draft heads (Medusa, EAGLE-1/2, EAGLE-3 and its variants), their losses, the checkpoint format, published
layouts read and exported, and the registry of head kinds."""
