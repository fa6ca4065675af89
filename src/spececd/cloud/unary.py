"""Deprecated: unary verification is transport work and lives in
:mod:`spececd.transports.unary`; this module re-exports its names so that existing imports
keep working."""

from __future__ import annotations

from spececd.transports.unary import UnaryParams, UnarySessions, UnaryVerdict

__all__ = ["UnaryParams", "UnarySessions", "UnaryVerdict"]
