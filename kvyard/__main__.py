"""`python -m kvyard`: the command line (launcher/cli.py); with no arguments, start the roles ROLE_TYPE names."""
import sys

from launcher.safe_path import drop_start_directory

drop_start_directory()  # before anything else is imported: launcher/safe_path.py

from launcher.cli import main  # noqa: E402

sys.exit(main())
