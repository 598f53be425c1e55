"""`python -m launcher +exp=<name> [overrides]`: see launcher/cli.py."""
from launcher.cli import main

main()
