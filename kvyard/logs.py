"""One log format for every role, so interleaved PDFUSION output says which process wrote each line."""
from __future__ import annotations

import logging
import os


def setup_logging(component: str) -> None:
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "INFO",
                        format=f"%(asctime)s %(levelname)s [{component}] %(name)s: %(message)s",
                        force=True)
