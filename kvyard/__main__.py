"""`python -m kvyard`: the command line (kvyard/cli.py); with no arguments, start the roles ROLE_TYPE names."""
import sys

from kvyard.cli import main

sys.exit(main())
