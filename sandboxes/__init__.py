"""Sandbox backends behind one async protocol."""

from .base import ISOLATION_ORDER, ExecResult, Isolation, Sandbox

__all__ = ["ISOLATION_ORDER", "ExecResult", "Isolation", "Sandbox"]
