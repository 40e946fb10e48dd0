"""The trainers' command-line scripts, TRL's way: ``posttrain.scripts.<name>.main(argv=None)``."""
