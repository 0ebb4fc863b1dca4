"""Bad command-line input: one line on stderr and exit code 2, raised by the parsers (cli.py) and the cluster's
layout (local_cluster.py) alike."""
from __future__ import annotations

USAGE_ERROR = 2


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""
