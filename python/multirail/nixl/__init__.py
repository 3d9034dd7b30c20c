"""NIXL's Python API on the multirail engine, laid out like the `nixl` package.

A NIXL script runs after replacing its import lines only (docs/nixl.md):

    nixl._api, nixl   -> multirail.nixl
    nixl._utils       -> multirail.nixl.utils
    nixl._bindings    -> multirail.nixl.bindings
    nixl.logging      -> multirail.nixl.logging

Importing this package does not need the engine extension; making an agent does.
"""

from multirail.nixl._api import (  # noqa: F401
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    deserialize_descs,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_reg_dlist,
    nixl_thread_sync_t,
    nixl_xfer_dlist,
    nixl_xfer_handle,
    nixl_xfer_telemetry,
    nixlRegDList,
    nixlRemoteDList,
    nixlXferDList,
    serialize_descs,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
