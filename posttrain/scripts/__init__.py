"""The trainers' command-line scripts, TRL's way (``trl/scripts/``): ``posttrain.scripts.<name>``
has ``main(argv=None)``; ``posttrain <name>`` and examples/<name>.py both run it. Settings are
parsed in one place, :mod:`posttrain.scripts.args`."""
