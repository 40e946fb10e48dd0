"""The models a trainer is given and how a trained one is set up: their sources and tokenizer, LoRA,
the one preparation every trained role goes through, compiled layers and varlen attention."""
