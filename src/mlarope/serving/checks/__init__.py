"""Every host-side check of the serving ops, one module per op over the shared ones
(:mod:`.common`); each ``check_*_call`` returns the op's checked call, whose fields are what
the custom op and the backends take."""

from __future__ import annotations

from .append import AppendCall, check_append_call, validate_append_on_device
from .output import OutputCall, check_output_call, refuse_table_halves, validate_output_on_device
from .query import QueryCall, check_query_call, validate_query_on_device
from .read import check_read_call

__all__ = [
    "AppendCall",
    "OutputCall",
    "QueryCall",
    "check_append_call",
    "check_output_call",
    "check_query_call",
    "check_read_call",
    "refuse_table_halves",
    "validate_append_on_device",
    "validate_output_on_device",
    "validate_query_on_device",
]
