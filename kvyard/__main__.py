"""`python -m kvyard`: the command line (launcher/cli.py); with no arguments, start the roles ROLE_TYPE names."""
import sys

from launcher.cli import main

sys.exit(main())
