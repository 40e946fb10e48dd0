"""The role layer: each model role under its own DeepSpeed plugin, the Session that owns them, and
the fast frozen ZeRO-3 path."""
