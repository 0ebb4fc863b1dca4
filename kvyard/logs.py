"""One log format for every role, so interleaved PDFUSION output says which process wrote each line."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from kvyard.errors import ErrorCode, RequestError

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


def set_process_log_level(value: object) -> str:
    """POST /set_log_level's body `log_level` (RTP-LLM's names, TRACE = DEBUG) applied to this process's root
    logger; returns the level set. Anything else is a 400 naming the field."""
    level = value.upper() if isinstance(value, str) else ""
    if level not in LEVELS:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"log_level must be one of {', '.join(LEVELS)}, got {value!r}",
                           "log_level")
    level = "DEBUG" if level == "TRACE" else level
    logging.getLogger().setLevel(level)
    return level
