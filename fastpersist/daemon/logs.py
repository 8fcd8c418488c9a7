"""Structured logs: one JSON object per line on stderr (journald and kubectl
logs keep lines), or plain text for a terminal."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

logger = logging.getLogger("fastpersistd")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp} {record.levelname.lower():7s} {record.getMessage()} {fields}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def event(level: int, name: str, **fields: Any) -> None:
    """Log `name` with key=value fields (checkpoint id, client, path, bytes...)."""
    logger.log(level, name, extra={"fields": fields})


def debug(name: str, **fields: Any) -> None:
    event(logging.DEBUG, name, **fields)


def info(name: str, **fields: Any) -> None:
    event(logging.INFO, name, **fields)


def warning(name: str, **fields: Any) -> None:
    event(logging.WARNING, name, **fields)


def error(name: str, **fields: Any) -> None:
    event(logging.ERROR, name, **fields)
