"""The exception hierarchy. Every error the engine raises is a `MultirailError`.

The Rust core maps each of its typed error variants onto exactly one of these classes
(crates/multirail-py/src/errors.rs). Where a built-in fits, the class also derives from it
(`TimeoutError`, `ValueError`, `KeyError`, `PermissionError`, `OSError`), so generic handlers
keep working.
"""

from __future__ import annotations


class MultirailError(Exception):
    """Base class of every multirail error."""


class InvalidArgumentError(MultirailError, ValueError):
    """A malformed argument: bad descriptor array, unknown op, bad config value."""


class UnknownPeerError(MultirailError, KeyError):
    """No metadata is loaded for the named peer."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class NotRegisteredError(MultirailError, ValueError):
    """A local descriptor is not inside memory registered with this agent."""


class OutOfBoundsError(MultirailError, ValueError):
    """A remote descriptor falls outside the peer's exported regions."""


class LengthMismatchError(MultirailError, ValueError):
    """Local and remote descriptor lists differ in total length."""


class AccessDeniedError(MultirailError, PermissionError):
    """The peer refused the operation (wrong key, unknown region)."""


class ReadOnlyError(AccessDeniedError):
    """WRITE into a region registered read-only."""


class ProtocolError(MultirailError):
    """Bytes from a peer that do not fit the protocol (garbage, truncated, oversized)."""


class VersionMismatchError(ProtocolError):
    """The peer speaks another protocol or metadata version."""


class MetadataError(ProtocolError):
    """Metadata or a descriptor list could not be parsed, or is stale."""


class StaleMetadataError(MetadataError):
    """Metadata from an earlier life of a peer (its incarnation changed)."""


class AuthenticationError(MultirailError, PermissionError):
    """The shared-secret handshake failed."""


class PeerLostError(MultirailError, ConnectionError):
    """The peer vanished (connection refused, reset or closed) and no rail is left."""


class TransferTimeoutError(MultirailError, TimeoutError):
    """A transfer, connection or wait exceeded its timeout."""


class AddressInUseError(MultirailError, OSError):
    """The listen address is already taken."""


class TransferError(MultirailError):
    """A transfer failed for a reason not covered above; the message says why."""


class TransportUnavailableError(MultirailError, ImportError):
    """The chosen transport cannot run here (e.g. transport="ucx" without a UCX library); the
    message says what was tried and how to install it (`pip install "multirail[ucx]"`)."""


class GpuError(MultirailError):
    """GPU memory cannot be used here: no CUDA runtime or no usable GPU (the message names the
    cause and how to install), an address CUDA does not know as device memory, or a transfer of
    GPU memory, which no transport of this build moves yet (issue 10: docs/gpu.md)."""


class MetadataStoreError(MultirailError, ConnectionError):
    """The metadata store (etcd) is unreachable, timed out or refused a request.

    Python only (python/multirail/metadata.py): the engine never raises it."""


__all__ = [name for name in dir() if name.endswith("Error")]
