"""Deprecated: the session state machines now live in their own modules,
:mod:`spececd.protocol.cloud_session` (the verifier's side) and
:mod:`spececd.protocol.edge_session` (the drafter's side). This module re-exports their
names so that existing imports keep working; import from the new modules instead.
"""

from __future__ import annotations

from spececd.protocol.cloud_session import (
    PROB_SUM_TOLERANCE,
    CloudSession,
    Event,
    GenerateRequest,
    Limits,
    State,
    StepOut,
    Stream,
    VerifyRequest,
    common_prefix,
)
from spececd.protocol.edge_session import EdgeSession

__all__ = ["PROB_SUM_TOLERANCE", "CloudSession", "EdgeSession", "Event", "GenerateRequest",
           "Limits", "State", "StepOut", "Stream", "VerifyRequest", "common_prefix"]
