"""Data in TRL's formats: preference pairs, SFT rows and packing, prompts, and the order rows are seen in."""
