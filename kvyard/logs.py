"""One log format for every role, so interleaved PDFUSION output says which process wrote each line."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE")  # TRACE is DEBUG (RTP-LLM's name)


def check_log_level(env: Mapping[str, str]) -> None:
    level = env.get("LOG_LEVEL", "") or "INFO"
    if level.upper() not in LEVELS:
        raise ValueError(f"LOG_LEVEL must be one of {', '.join(LEVELS)}, got {level!r}")


def setup_logging(component: str, env: Mapping[str, str] = os.environ) -> None:
    level = (env.get("LOG_LEVEL", "") or "INFO").upper()
    level = "DEBUG" if level == "TRACE" else level
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "INFO",
                        format=f"%(asctime)s %(levelname)s [{component}] %(name)s: %(message)s",
                        force=True)
