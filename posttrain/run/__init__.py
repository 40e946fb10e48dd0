"""What a run writes and reads back: its output dir, checkpoints, model card, metrics rows, the final model,
interrupts and posttrain's cache."""
