"""Trained models' set-up: loading, LoRA, compiled layers and varlen attention."""
