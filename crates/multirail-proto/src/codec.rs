//! Wire format shared by the side channel and the data plane (documented in
//! docs/PROTOCOL.md).
//!
//! Every message is a fixed 16-byte [`Header`] followed by `body_len` bytes of body, whose
//! maximum is fixed per [`Kind`] and checked before the body is read. Two kinds carry bulk
//! data after the body: `WriteReq` (the bytes to write) and a successful `Resp` to a
//! `ReadReq` (the bytes read). Bulk lengths are bounded by [`MAX_CHUNK`] and, on the target,
//! by the bounds of the registered region they address, so bulk data always moves straight
//! between the socket and registered memory.

use crate::meta::RegionKey;
use crate::reader::{put_str16, Reader};

pub const MAGIC: [u8; 2] = *b"MR";
/// The protocol version this build speaks. A peer with another version gets
/// [`Status::VersionMismatch`] and the connection is closed.
pub const VERSION: u8 = 1;
/// The newest `Hello` version this build speaks (the header byte stays [`VERSION`]). Version 2
/// adds the vectored requests (`ReadVReq`, `WriteVReq`); a server accepts `Hello` versions 1
/// and 2, and a client that offers 2 to an older server (answered `Error(VersionMismatch)`)
/// dials again with 1 and sends no vectored request on that connection.
pub const HELLO_VERSION: u16 = 5;
/// The first `Hello` version whose connections may carry `ReadVReq` / `WriteVReq`.
pub const HELLO_VECTORED: u16 = 2;
/// The first `Hello` version whose server takes `ReadVReq` / `WriteVReq` on GPU regions too
/// (staged through its pinned buffers). An older server refuses them (`Unexpected`), so an
/// initiator sends them only where every connection of every rail accepted this version.
pub const HELLO_VECTORED_GPU: u16 = 4;
/// The `Hello` version a `Role::UcxSession` connection offers (other roles offer
/// [`HELLO_VERSION`]): version 3 adds a trailing u32 feature word to `UcxOpen` and `UcxReady`
/// (`UCX_FEATURE_*`). A server of this build accepts 1 to 3; an older one answers
/// `Error(VersionMismatch)` and the client dials again one version lower.
pub const HELLO_UCX_FEATURES: u16 = 3;
/// The first `Hello` version whose control connections may carry `NotifSeq` (numbered
/// notifications, queued once however often a lost answer makes the initiator resend them).
pub const HELLO_NOTIF_SEQ: u16 = 5;
/// The newest `Hello` version a server of this build accepts.
pub const HELLO_MAX: u16 = HELLO_NOTIF_SEQ;
/// `UcxOpen`/`UcxReady` feature bit: the session carries vectored chunks as UCP active messages
/// (one request per chunk with its piece list, scattered and bounds-checked by the target;
/// [`UcxAm`]). Offered by the initiator, echoed by a target that serves it.
pub const UCX_FEATURE_AM: u32 = 1;
/// Most piece entries in one vectored request (an entry is one piece or one strided run).
pub const MAX_VEC_ENTRIES: usize = 16384;
/// Most pieces one vectored request names once its strided entries are counted out (the
/// target copies or sends each piece on its own).
pub const MAX_VEC_PIECES: u64 = 1 << 16;
/// Largest encoded piece entry: u64 offset, u32 len, u32 count, u64 stride (the stride only
/// when count > 1).
const VEC_ENTRY_MAX: usize = 8 + 4 + 4 + 8;
pub const HEADER_LEN: usize = 16;
/// Largest bulk payload one request may carry.
pub const MAX_CHUNK: u64 = 64 << 20;
/// Largest notification payload.
pub const MAX_NOTIF: usize = 1 << 20;
/// Largest serialised metadata blob.
pub const MAX_META: usize = 16 << 20;
/// Longest agent name.
pub const MAX_NAME: usize = 255;
/// Most connections one `Fence` names.
pub const MAX_FENCE: usize = 256;
/// Longest error message carried in a response.
pub const MAX_MSG: usize = 512;
/// Longest UCX worker address (`UcxOpen`, `UcxReady`).
pub const MAX_UCX_ADDR: usize = 64 * 1024;
/// Longest packed UCX remote key of one region.
pub const MAX_UCX_RKEY: usize = 16 * 1024;
/// Most regions one `UcxReady` lists.
pub const MAX_UCX_REGIONS: usize = 1 << 16;
/// Largest `UcxReady` body; regions that do not fit are left out (the initiator asks for them
/// with `UcxRkeys` when it needs them).
pub const MAX_UCX_READY: usize = 16 << 20;
/// Most region ids one `UcxRkeys` asks for.
pub const MAX_UCX_RKEYS: usize = 4096;
/// Most regions one `IpcReq` names (and one `IpcHandles` answers).
pub const MAX_IPC_REGIONS: usize = 1024;
/// Most regions one `IpcRevoke` (and its `IpcReleased`) names.
pub const MAX_IPC_REVOKE: usize = 1024;
/// Encoded size of one `IpcEntry`: region, device, device UUID, handle, offset, allocation length.
const IPC_ENTRY: usize = 8 + 4 + 16 + 64 + 8 + 8;
/// Encoded size of a `UcxRegion` without its rkey bytes: id, base, len, rkey length.
const UCX_REGION_FIXED: usize = 8 + 8 + 8 + 2;

/// Message kinds. The numeric values are part of the wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client -> server, first message on every connection.
    Hello = 1,
    /// Server -> client: nonce and whether a shared-secret proof is required.
    Challenge = 2,
    /// Client -> server: HMAC proof over both nonces.
    Auth = 3,
    /// Server -> client: accepted; carries the server's own proof.
    Welcome = 4,
    ReadReq = 10,
    WriteReq = 11,
    /// Client -> server (`Hello` version >= 2): READ many pieces of one region; a successful
    /// `Resp` carries them back to back as one bulk stream.
    ReadVReq = 15,
    /// Client -> server (`Hello` version >= 2): WRITE many pieces of one region; followed by
    /// the pieces' bytes back to back.
    WriteVReq = 16,
    Notif = 12,
    /// Client -> server (`Hello` version >= 5): a notification with its sender's incarnation
    /// and a number unique within it; the server queues each (peer, incarnation, number) once.
    NotifSeq = 17,
    Ping = 13,
    /// Client -> server: stop applying anything from the listed connections of this peer (by
    /// their `Hello` nonces) and close them; answered with `Resp` once none of them can touch
    /// memory any more. Sent before reissuing a dead rail's WRITEs elsewhere.
    Fence = 14,
    Resp = 20,
    MetaGet = 30,
    Meta = 31,
    MetaPut = 32,
    /// Client -> server, first message on a `Role::UcxSession` connection: the rail whose UCX
    /// context the session uses and the initiator's worker address.
    UcxOpen = 50,
    /// Server -> client: the session worker's address and the packed rkeys (from that rail's
    /// context) of the regions this agent exports. Also the answer to `UcxRkeys` (then with an
    /// empty address).
    UcxReady = 51,
    /// Client -> server: rkeys of regions registered after the session opened.
    UcxRkeys = 52,
    /// Client -> server (control connection): CUDA IPC handles of these exported GPU regions,
    /// from a peer on the same host (its host id), naming the peer's `Role::IpcWatch`
    /// connection that revocations go to. Answered with `IpcHandles`, or a refusal.
    IpcReq = 53,
    /// Server -> client: one handle per requested region (a capability: authenticated only).
    IpcHandles = 54,
    /// Server -> client, on a `Role::IpcWatch` connection: these regions are being
    /// deregistered; close their IPC mappings. Answered with `IpcReleased` (same request id).
    IpcRevoke = 55,
    /// Client -> server, on a `Role::IpcWatch` connection: the regions of an `IpcRevoke` are
    /// unmapped and no copy uses them any more.
    IpcReleased = 56,
    /// Fatal connection-level error; the sender closes the connection after it.
    Error = 40,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Challenge,
            3 => Auth,
            4 => Welcome,
            10 => ReadReq,
            11 => WriteReq,
            15 => ReadVReq,
            16 => WriteVReq,
            12 => Notif,
            17 => NotifSeq,
            13 => Ping,
            14 => Fence,
            20 => Resp,
            30 => MetaGet,
            31 => Meta,
            32 => MetaPut,
            50 => UcxOpen,
            51 => UcxReady,
            52 => UcxRkeys,
            53 => IpcReq,
            54 => IpcHandles,
            55 => IpcRevoke,
            56 => IpcReleased,
            40 => Error,
            _ => return None,
        })
    }

    /// The largest body a message of this kind may have.
    pub fn max_body(self) -> usize {
        use Kind::*;
        match self {
            Hello => 2 + 1 + 8 + 2 + MAX_NAME + 16,
            Challenge => 1 + 8 + 16 + 2 + MAX_NAME,
            Auth => 32,
            Welcome => 32,
            ReadReq | WriteReq => 8 + 16 + 8 + 8,
            ReadVReq | WriteVReq => 8 + 16 + 4 + VEC_ENTRY_MAX * MAX_VEC_ENTRIES,
            Notif => MAX_NOTIF,
            NotifSeq => 16 + MAX_NOTIF,
            Ping => 0,
            Fence => 2 + 16 * MAX_FENCE,
            Resp | Error => 2 + 8 + 2 + MAX_MSG,
            MetaGet => 0,
            Meta | MetaPut => MAX_META,
            UcxOpen => 2 + 4 + MAX_UCX_ADDR + 36,
            UcxReady => MAX_UCX_READY + 36,
            UcxRkeys => 4 + 8 * MAX_UCX_RKEYS,
            IpcReq => 16 + 16 + 2 + (8 + 16) * MAX_IPC_REGIONS,
            IpcHandles => 2 + IPC_ENTRY * MAX_IPC_REGIONS,
            IpcRevoke | IpcReleased => 2 + 8 * MAX_IPC_REVOKE,
        }
    }
}

/// Outcome codes carried by `Resp` and `Error`. The numeric values are part of the wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    /// No region with that id is exported to this peer.
    UnknownRegion = 1,
    /// The key does not match the region.
    BadKey = 2,
    /// offset + len falls outside the region.
    OutOfBounds = 3,
    /// WRITE into a region registered read-only.
    ReadOnly = 4,
    /// A length over the protocol's bounds.
    TooLarge = 5,
    /// The message could not be decoded.
    Malformed = 6,
    /// The peer speaks another protocol version.
    VersionMismatch = 7,
    /// The shared-secret proof was wrong or missing.
    AuthFailed = 8,
    /// The request kind is not allowed on this connection or in this state.
    Unexpected = 9,
    /// The server is out of a bounded resource (connections, in-flight work).
    Busy = 10,
    /// Anything else; the message says what.
    Internal = 11,
}

impl Status {
    pub fn from_u16(v: u16) -> Status {
        use Status::*;
        match v {
            0 => Ok,
            1 => UnknownRegion,
            2 => BadKey,
            3 => OutOfBounds,
            4 => ReadOnly,
            5 => TooLarge,
            6 => Malformed,
            7 => VersionMismatch,
            8 => AuthFailed,
            9 => Unexpected,
            10 => Busy,
            _ => Internal,
        }
    }
}

/// Why bytes from the wire were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The first two bytes are not `MR`: not a multirail peer.
    #[error("bad magic {0:02x?}: not a multirail peer")]
    BadMagic([u8; 2]),
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: peer speaks {got}, this build speaks {want}")]
    VersionMismatch { got: u8, want: u8 },
    /// The kind byte names no message.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The body length is over the bound of its kind.
    #[error("{kind:?} body of {len} bytes exceeds the limit of {max}")]
    BodyTooLarge { kind: Kind, len: usize, max: usize },
    /// Fewer bytes than the schema needs.
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    /// A count or length over its bound.
    #[error("too many {what}: {n} > {max}")]
    TooMany { what: &'static str, n: u64, max: u64 },
    /// Bytes that do not fit the schema.
    #[error("malformed: {0}")]
    Malformed(&'static str),
}

/// Why a body could not be encoded: a value does not fit its wire field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A length or count over what its field holds (a caller's bug: the planner cuts chunks
    /// far below these bounds). Nothing was sent.
    #[error("{what} {n} does not fit its {max}-max wire field")]
    TooLarge { what: &'static str, n: u64, max: u64 },
}

/// `n` as a u32 wire field, or the error naming `what`.
fn fit32(what: &'static str, n: u64) -> Result<u32, EncodeError> {
    u32::try_from(n).map_err(|_| EncodeError::TooLarge { what, n, max: u32::MAX as u64 })
}

/// The fixed 16-byte header: magic, version, kind, body length, request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub body_len: u32,
    pub req_id: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..2].copy_from_slice(&MAGIC);
        h[2] = VERSION;
        h[3] = self.kind as u8;
        h[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        h[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        h
    }

    /// Rewrite the request id of an encoded frame (one encoded before its id was drawn).
    /// `frame` starts with a header (as every `Body::encode` output does).
    pub fn set_req_id(frame: &mut [u8], req_id: u64) {
        frame[8..16].copy_from_slice(&req_id.to_le_bytes());
    }

    /// Parse and bound-check a header. The body length is checked against the kind's
    /// maximum here, before the caller reads or allocates anything for the body.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Header, DecodeError> {
        if h[0..2] != MAGIC {
            return Err(DecodeError::BadMagic([h[0], h[1]]));
        }
        if h[2] != VERSION {
            return Err(DecodeError::VersionMismatch { got: h[2], want: VERSION });
        }
        let kind = Kind::from_u8(h[3]).ok_or(DecodeError::UnknownKind(h[3]))?;
        let body_len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if body_len as usize > kind.max_body() {
            return Err(DecodeError::BodyTooLarge { kind, len: body_len as usize, max: kind.max_body() });
        }
        let req_id = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        Ok(Header { kind, body_len, req_id })
    }
}

/// Role announced in `Hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Metadata exchange and notifications only.
    Control = 1,
    /// A data connection on one rail.
    Data = 2,
    /// A UCX session on one rail: `UcxOpen` / `UcxReady`, then the target progresses a worker of
    /// its own for this session until the connection closes or is fenced.
    UcxSession = 3,
    /// CUDA IPC revocation (same host): opened by an initiator before its first `IpcReq`;
    /// the target pushes `IpcRevoke` on it when it deregisters a region the initiator mapped,
    /// and the initiator answers `IpcReleased` once the mapping is closed.
    IpcWatch = 4,
}

/// One exported region in `UcxReady`: where it is and its packed UCX rkey (a capability: sent
/// only over an authenticated session, never in published metadata).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxRegion {
    pub id: u64,
    pub base: u64,
    pub len: u64,
    /// At most [`MAX_UCX_RKEY`] bytes.
    pub rkey: Vec<u8>,
}

/// One GPU region's CUDA IPC handle in `IpcHandles`: the handle maps the whole allocation
/// that contains the region, which starts `offset` bytes into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcEntry {
    pub region: u64,
    /// The exporter's device ordinal (in its own process; informational).
    pub device: u32,
    /// The exporter's device UUID: the initiator opens the handle on its device with this UUID
    /// (ordinals differ between processes with different `CUDA_VISIBLE_DEVICES`).
    pub uuid: [u8; 16],
    pub handle: [u8; 64],
    pub offset: u64,
    pub alloc_len: u64,
}

/// A one-sided request against a remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteOp {
    pub region: u64,
    pub key: RegionKey,
    pub offset: u64,
    pub len: u64,
}

/// One entry of a vectored request: `count` pieces of `len` bytes, piece `k` at
/// `offset + k * stride` of the region (`stride` is 0 and unused when `count` is 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VecPiece {
    pub offset: u64,
    pub len: u64,
    pub count: u64,
    pub stride: u64,
}

impl VecPiece {
    /// Bytes of all its pieces (bounded at decode: at most [`MAX_CHUNK`] in a request).
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// One past the last byte it touches, or None on overflow.
    pub fn end(&self) -> Option<u64> {
        self.count.checked_sub(1)?.checked_mul(self.stride)?.checked_add(self.offset)?.checked_add(self.len)
    }
}

/// A vectored one-sided request: many pieces of one region (at most [`MAX_VEC_ENTRIES`]
/// entries, [`MAX_VEC_PIECES`] pieces and [`MAX_CHUNK`] bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VecOp {
    pub region: u64,
    pub key: RegionKey,
    pub pieces: Vec<VecPiece>,
}

impl VecOp {
    /// Bytes of all pieces: the bulk length of the request (WRITE) or its answer (READ).
    pub fn total(&self) -> u64 {
        self.pieces.iter().map(|p| p.bytes()).sum()
    }
}

/// Decoded message bodies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    Hello {
        /// The `Hello` version offered (1 or [`HELLO_VERSION`]).
        version: u16,
        role: Role,
        incarnation: u64,
        name: String,
        nonce: [u8; 16],
    },
    Challenge {
        auth_required: bool,
        incarnation: u64,
        nonce: [u8; 16],
        name: String,
    },
    Auth {
        mac: [u8; 32],
    },
    Welcome {
        mac: [u8; 32],
    },
    ReadReq(RemoteOp),
    /// Followed on the wire by `op.len` bulk bytes.
    WriteReq(RemoteOp),
    ReadVReq(VecOp),
    /// Followed on the wire by `op.total()` bulk bytes, the pieces in order.
    WriteVReq(VecOp),
    Notif(Vec<u8>),
    NotifSeq {
        incarnation: u64,
        seq: u64,
        msg: Vec<u8>,
    },
    Ping,
    /// Hello nonces of this peer's connections to fence (at most [`MAX_FENCE`]).
    Fence(Vec<[u8; 16]>),
    /// For a successful READ, followed on the wire by `bulk_len` bytes.
    Resp {
        status: Status,
        bulk_len: u64,
        msg: String,
    },
    MetaGet,
    Meta(Vec<u8>),
    MetaPut(Vec<u8>),
    Error {
        status: Status,
        msg: String,
    },
    UcxOpen {
        rail: u16,
        /// At most [`MAX_UCX_ADDR`] bytes.
        addr: Vec<u8>,
        /// `UCX_FEATURE_*` bits offered. On the wire only when not 0 or with a MAC (a
        /// trailing u32), and only to a peer that accepted `Hello` version [`HELLO_UCX_FEATURES`].
        features: u32,
        /// HMAC-SHA256 of the body (everything before it), keyed by the session's handshake
        /// (docs/PROTOCOL.md, "UCX sessions"); after the feature word, which is then always
        /// sent. `None`: a peer from before issue 33 (refused: UCX sessions need a secret).
        mac: Option<[u8; 32]>,
    },
    UcxReady {
        /// At most [`MAX_UCX_ADDR`] bytes; empty in the answer to `UcxRkeys`.
        addr: Vec<u8>,
        /// Encoding leaves out regions with an rkey over [`MAX_UCX_RKEY`] and those past
        /// [`MAX_UCX_REGIONS`] or the [`MAX_UCX_READY`] body bound.
        regions: Vec<UcxRegion>,
        /// The offered `UCX_FEATURE_*` bits this target serves (a trailing u32 when not 0 or
        /// with a MAC).
        features: u32,
        /// As `UcxOpen`'s: the MAC of the body, keyed by the session's handshake.
        mac: Option<[u8; 32]>,
    },
    /// Region ids (at most [`MAX_UCX_RKEYS`]).
    UcxRkeys(Vec<u64>),
    /// The requester's host id, the connection id of its `Role::IpcWatch` connection, and the
    /// regions (id, key) it wants to map; at most [`MAX_IPC_REGIONS`].
    IpcReq {
        host: [u8; 16],
        watch: [u8; 16],
        regions: Vec<(u64, RegionKey)>,
    },
    /// At most [`MAX_IPC_REGIONS`].
    IpcHandles(Vec<IpcEntry>),
    /// Region ids whose mappings must be closed (at most [`MAX_IPC_REVOKE`]).
    IpcRevoke(Vec<u64>),
    /// Region ids whose mappings are closed (at most [`MAX_IPC_REVOKE`]).
    IpcReleased(Vec<u64>),
}

impl Body {
    pub fn kind(&self) -> Kind {
        match self {
            Body::Hello { .. } => Kind::Hello,
            Body::Challenge { .. } => Kind::Challenge,
            Body::Auth { .. } => Kind::Auth,
            Body::Welcome { .. } => Kind::Welcome,
            Body::ReadReq(_) => Kind::ReadReq,
            Body::WriteReq(_) => Kind::WriteReq,
            Body::ReadVReq(_) => Kind::ReadVReq,
            Body::WriteVReq(_) => Kind::WriteVReq,
            Body::Notif(_) => Kind::Notif,
            Body::NotifSeq { .. } => Kind::NotifSeq,
            Body::Ping => Kind::Ping,
            Body::Fence(_) => Kind::Fence,
            Body::Resp { .. } => Kind::Resp,
            Body::MetaGet => Kind::MetaGet,
            Body::Meta(_) => Kind::Meta,
            Body::MetaPut(_) => Kind::MetaPut,
            Body::Error { .. } => Kind::Error,
            Body::UcxOpen { .. } => Kind::UcxOpen,
            Body::UcxReady { .. } => Kind::UcxReady,
            Body::UcxRkeys(_) => Kind::UcxRkeys,
            Body::IpcReq { .. } => Kind::IpcReq,
            Body::IpcHandles(_) => Kind::IpcHandles,
            Body::IpcRevoke(_) => Kind::IpcRevoke,
            Body::IpcReleased(_) => Kind::IpcReleased,
        }
    }

    /// Encode header and body into one buffer (bulk data, if any, is sent separately).
    ///
    /// # Panics
    /// If a length or count does not fit its wire field (see [`Body::try_encode`]): only for
    /// bodies bounded by construction (responses, control frames, tests). A body whose sizes
    /// come from a caller (vectored requests, blobs) goes through `try_encode`.
    pub fn encode(&self, req_id: u64) -> Vec<u8> {
        match self.try_encode(req_id) {
            Ok(b) => b,
            Err(e) => panic!("{:?} body cannot be encoded: {e}", self.kind()),
        }
    }

    /// Encode header and body into one buffer, or a typed error when a piece length, piece
    /// count, entry count or the body length does not fit its u32 wire field (never a
    /// silently truncated frame that would decode to a different request). The check is one
    /// comparison per field on the way.
    pub fn try_encode(&self, req_id: u64) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(HEADER_LEN + 64);
        out.extend_from_slice(&[0u8; HEADER_LEN]);
        match self {
            Body::Hello { version, role, incarnation, name, nonce } => {
                out.extend_from_slice(&version.to_le_bytes());
                out.push(*role as u8);
                out.extend_from_slice(&incarnation.to_le_bytes());
                put_str16(&mut out, truncate(name, MAX_NAME));
                out.extend_from_slice(nonce);
            }
            Body::Challenge { auth_required, incarnation, nonce, name } => {
                out.push(*auth_required as u8);
                out.extend_from_slice(&incarnation.to_le_bytes());
                out.extend_from_slice(nonce);
                put_str16(&mut out, truncate(name, MAX_NAME));
            }
            Body::Auth { mac } | Body::Welcome { mac } => out.extend_from_slice(mac),
            Body::ReadReq(op) | Body::WriteReq(op) => {
                out.extend_from_slice(&op.region.to_le_bytes());
                out.extend_from_slice(&op.key.0);
                out.extend_from_slice(&op.offset.to_le_bytes());
                out.extend_from_slice(&op.len.to_le_bytes());
            }
            Body::ReadVReq(op) | Body::WriteVReq(op) => {
                // The caller keeps within the bounds (the planner cuts chunks to them); a
                // request over them is refused by the peer, never truncated here.
                out.reserve(8 + 16 + 4 + 16 * op.pieces.len());
                out.extend_from_slice(&op.region.to_le_bytes());
                out.extend_from_slice(&op.key.0);
                out.extend_from_slice(&fit32("vectored entries", op.pieces.len() as u64)?.to_le_bytes());
                for p in &op.pieces {
                    out.extend_from_slice(&p.offset.to_le_bytes());
                    out.extend_from_slice(&fit32("vectored piece length", p.len)?.to_le_bytes());
                    out.extend_from_slice(&fit32("vectored piece count", p.count)?.to_le_bytes());
                    if p.count != 1 {
                        out.extend_from_slice(&p.stride.to_le_bytes());
                    }
                }
            }
            Body::Notif(b) | Body::Meta(b) | Body::MetaPut(b) => out.extend_from_slice(b),
            Body::NotifSeq { incarnation, seq, msg } => {
                out.extend_from_slice(&incarnation.to_le_bytes());
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(msg);
            }
            Body::Ping | Body::MetaGet => {}
            Body::Fence(ids) => {
                let ids = &ids[..ids.len().min(MAX_FENCE)];
                out.extend_from_slice(&(ids.len() as u16).to_le_bytes());
                for id in ids {
                    out.extend_from_slice(id);
                }
            }
            Body::Resp { status, bulk_len, msg } => {
                out.extend_from_slice(&(*status as u16).to_le_bytes());
                out.extend_from_slice(&bulk_len.to_le_bytes());
                put_str16(&mut out, truncate(msg, MAX_MSG));
            }
            Body::Error { status, msg } => {
                out.extend_from_slice(&(*status as u16).to_le_bytes());
                out.extend_from_slice(&0u64.to_le_bytes());
                put_str16(&mut out, truncate(msg, MAX_MSG));
            }
            Body::UcxOpen { rail, addr, features, mac } => {
                out.extend_from_slice(&rail.to_le_bytes());
                put_blob32(&mut out, &addr[..addr.len().min(MAX_UCX_ADDR)]);
                put_ucx_tail(&mut out, *features, mac);
            }
            Body::UcxReady { addr, regions, features, mac } => {
                put_blob32(&mut out, &addr[..addr.len().min(MAX_UCX_ADDR)]);
                let count_at = out.len();
                out.extend_from_slice(&0u32.to_le_bytes());
                let mut n = 0u32;
                for g in regions {
                    if g.rkey.len() > MAX_UCX_RKEY || n as usize >= MAX_UCX_REGIONS {
                        continue;
                    }
                    if out.len() - HEADER_LEN + UCX_REGION_FIXED + g.rkey.len() > MAX_UCX_READY {
                        continue;
                    }
                    out.extend_from_slice(&g.id.to_le_bytes());
                    out.extend_from_slice(&g.base.to_le_bytes());
                    out.extend_from_slice(&g.len.to_le_bytes());
                    out.extend_from_slice(&(g.rkey.len() as u16).to_le_bytes());
                    out.extend_from_slice(&g.rkey);
                    n += 1;
                }
                out[count_at..count_at + 4].copy_from_slice(&n.to_le_bytes());
                put_ucx_tail(&mut out, *features, mac);
            }
            Body::UcxRkeys(ids) => {
                let ids = &ids[..ids.len().min(MAX_UCX_RKEYS)];
                out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
                for id in ids {
                    out.extend_from_slice(&id.to_le_bytes());
                }
            }
            Body::IpcReq { host, watch, regions } => {
                out.extend_from_slice(host);
                out.extend_from_slice(watch);
                let regions = &regions[..regions.len().min(MAX_IPC_REGIONS)];
                out.extend_from_slice(&(regions.len() as u16).to_le_bytes());
                for (id, key) in regions {
                    out.extend_from_slice(&id.to_le_bytes());
                    out.extend_from_slice(&key.0);
                }
            }
            Body::IpcHandles(es) => {
                let es = &es[..es.len().min(MAX_IPC_REGIONS)];
                out.extend_from_slice(&(es.len() as u16).to_le_bytes());
                for e in es {
                    out.extend_from_slice(&e.region.to_le_bytes());
                    out.extend_from_slice(&e.device.to_le_bytes());
                    out.extend_from_slice(&e.uuid);
                    out.extend_from_slice(&e.handle);
                    out.extend_from_slice(&e.offset.to_le_bytes());
                    out.extend_from_slice(&e.alloc_len.to_le_bytes());
                }
            }
            Body::IpcRevoke(ids) | Body::IpcReleased(ids) => {
                let ids = &ids[..ids.len().min(MAX_IPC_REVOKE)];
                out.extend_from_slice(&(ids.len() as u16).to_le_bytes());
                for id in ids {
                    out.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
        let body_len = fit32("body length", (out.len() - HEADER_LEN) as u64)?;
        let h = Header { kind: self.kind(), body_len, req_id }.encode();
        out[..HEADER_LEN].copy_from_slice(&h);
        Ok(out)
    }

    /// Decode a body of the kind named by its (already validated) header.
    pub fn decode(kind: Kind, body: &[u8]) -> Result<Body, DecodeError> {
        if body.len() > kind.max_body() {
            return Err(DecodeError::BodyTooLarge { kind, len: body.len(), max: kind.max_body() });
        }
        let mut r = Reader::new(body);
        let b = match kind {
            Kind::Hello => {
                let version = r.u16()?;
                if !(1..=HELLO_MAX).contains(&version) {
                    return Err(DecodeError::VersionMismatch { got: version.min(255) as u8, want: HELLO_MAX as u8 });
                }
                let role = match r.u8()? {
                    1 => Role::Control,
                    2 => Role::Data,
                    3 => Role::UcxSession,
                    4 => Role::IpcWatch,
                    _ => return Err(DecodeError::Malformed("unknown role")),
                };
                let incarnation = r.u64()?;
                let name = r.str16("name bytes", MAX_NAME)?;
                let nonce = r.array()?;
                Body::Hello { version, role, incarnation, name, nonce }
            }
            Kind::ReadVReq | Kind::WriteVReq => {
                let op = decode_vec(&mut r)?;
                if kind == Kind::ReadVReq {
                    Body::ReadVReq(op)
                } else {
                    Body::WriteVReq(op)
                }
            }
            Kind::Challenge => {
                let auth_required = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError::Malformed("auth flag")),
                };
                let incarnation = r.u64()?;
                let nonce = r.array()?;
                let name = r.str16("name bytes", MAX_NAME)?;
                Body::Challenge { auth_required, incarnation, nonce, name }
            }
            Kind::Auth => Body::Auth { mac: r.array()? },
            Kind::Welcome => Body::Welcome { mac: r.array()? },
            Kind::ReadReq | Kind::WriteReq => {
                let op = RemoteOp { region: r.u64()?, key: RegionKey(r.array()?), offset: r.u64()?, len: r.u64()? };
                if op.len > MAX_CHUNK {
                    return Err(DecodeError::TooMany { what: "bytes in one request", n: op.len, max: MAX_CHUNK });
                }
                if kind == Kind::ReadReq {
                    Body::ReadReq(op)
                } else {
                    Body::WriteReq(op)
                }
            }
            Kind::Notif => Body::Notif(r.bytes(body.len())?.to_vec()),
            Kind::NotifSeq => {
                let (incarnation, seq) = (r.u64()?, r.u64()?);
                Body::NotifSeq { incarnation, seq, msg: r.bytes(body.len() - 16)?.to_vec() }
            }
            Kind::Meta => Body::Meta(r.bytes(body.len())?.to_vec()),
            Kind::MetaPut => Body::MetaPut(r.bytes(body.len())?.to_vec()),
            Kind::Ping => Body::Ping,
            Kind::Fence => {
                let n = r.u16()? as usize;
                if n > MAX_FENCE {
                    return Err(DecodeError::TooMany { what: "fenced connections", n: n as u64, max: MAX_FENCE as u64 });
                }
                let mut ids = Vec::with_capacity(n);
                for _ in 0..n {
                    ids.push(r.array()?);
                }
                Body::Fence(ids)
            }
            Kind::MetaGet => Body::MetaGet,
            Kind::UcxOpen => {
                let rail = r.u16()?;
                let addr = blob32(&mut r, "ucx worker address bytes", MAX_UCX_ADDR)?;
                let (features, mac) = ucx_tail(&mut r)?;
                Body::UcxOpen { rail, addr, features, mac }
            }
            Kind::UcxReady => {
                let addr = blob32(&mut r, "ucx worker address bytes", MAX_UCX_ADDR)?;
                let n = r.count("ucx regions", MAX_UCX_REGIONS, UCX_REGION_FIXED)?;
                let mut regions = Vec::with_capacity(n);
                for _ in 0..n {
                    let (id, base, len) = (r.u64()?, r.u64()?, r.u64()?);
                    let k = r.u16()? as usize;
                    if k > MAX_UCX_RKEY {
                        return Err(DecodeError::TooMany { what: "ucx rkey bytes", n: k as u64, max: MAX_UCX_RKEY as u64 });
                    }
                    regions.push(UcxRegion { id, base, len, rkey: r.bytes(k)?.to_vec() });
                }
                let (features, mac) = ucx_tail(&mut r)?;
                Body::UcxReady { addr, regions, features, mac }
            }
            Kind::UcxRkeys => {
                let n = r.count("ucx rkey requests", MAX_UCX_RKEYS, 8)?;
                let mut ids = Vec::with_capacity(n);
                for _ in 0..n {
                    ids.push(r.u64()?);
                }
                Body::UcxRkeys(ids)
            }
            Kind::IpcReq => {
                let host = r.array()?;
                let watch = r.array()?;
                let n = r.u16()? as usize;
                if n > MAX_IPC_REGIONS {
                    return Err(DecodeError::TooMany { what: "ipc regions", n: n as u64, max: MAX_IPC_REGIONS as u64 });
                }
                let mut regions = Vec::with_capacity(n.min(r.remaining() / 24));
                for _ in 0..n {
                    regions.push((r.u64()?, RegionKey(r.array()?)));
                }
                Body::IpcReq { host, watch, regions }
            }
            Kind::IpcHandles => {
                let n = r.u16()? as usize;
                if n > MAX_IPC_REGIONS {
                    return Err(DecodeError::TooMany { what: "ipc handles", n: n as u64, max: MAX_IPC_REGIONS as u64 });
                }
                let mut es = Vec::with_capacity(n.min(r.remaining() / IPC_ENTRY));
                for _ in 0..n {
                    es.push(IpcEntry {
                        region: r.u64()?,
                        device: r.u32()?,
                        uuid: r.array()?,
                        handle: r.array()?,
                        offset: r.u64()?,
                        alloc_len: r.u64()?,
                    });
                }
                Body::IpcHandles(es)
            }
            Kind::IpcRevoke | Kind::IpcReleased => {
                let n = r.u16()? as usize;
                if n > MAX_IPC_REVOKE {
                    return Err(DecodeError::TooMany { what: "revoked ipc regions", n: n as u64, max: MAX_IPC_REVOKE as u64 });
                }
                let mut ids = Vec::with_capacity(n.min(r.remaining() / 8));
                for _ in 0..n {
                    ids.push(r.u64()?);
                }
                if kind == Kind::IpcRevoke {
                    Body::IpcRevoke(ids)
                } else {
                    Body::IpcReleased(ids)
                }
            }
            Kind::Resp | Kind::Error => {
                let status = Status::from_u16(r.u16()?);
                let bulk_len = r.u64()?;
                if bulk_len > MAX_CHUNK {
                    return Err(DecodeError::TooMany { what: "bytes in one response", n: bulk_len, max: MAX_CHUNK });
                }
                let msg = r.str16("message bytes", MAX_MSG)?;
                if kind == Kind::Resp {
                    Body::Resp { status, bulk_len, msg }
                } else {
                    Body::Error { status, msg }
                }
            }
        };
        r.finish()?;
        Ok(b)
    }
}

/// Active-message id of a ucx session's vectored request (initiator -> target's session worker).
pub const UCX_AM_REQ: u16 = 0x4d52;
/// Active-message id of its reply (target -> initiator's rail worker).
pub const UCX_AM_REPLY: u16 = 0x4d53;
/// Bytes of a [`UcxAm`] header: u8 op (1 READ, 2 WRITE), u64 token, u32 descriptor length,
/// the session's 16-byte active-message secret.
pub const UCX_AM_REQ_HEADER: usize = 29;
/// Bytes of a reply header: u64 token, u16 status, the session's 16-byte active-message secret.
pub const UCX_AM_REPLY_HEADER: usize = 26;
/// Largest piece descriptor of a [`UcxAm`]: the `ReadVReq` body bound.
const UCX_AM_DESC_MAX: usize = 8 + 16 + 4 + VEC_ENTRY_MAX * MAX_VEC_ENTRIES;

/// A vectored chunk as one UCP active message (`UCX_FEATURE_AM`, docs/PROTOCOL.md "UCX active
/// messages"). The AM header is [`UCX_AM_REQ_HEADER`] bytes; the AM data is the piece
/// descriptor (exactly a `ReadVReq`/`WriteVReq` body: region, key, entries, with the same
/// bounds) followed, for a WRITE, by the pieces' bytes in entry order. The key is the region's
/// real key and `secret` the session's active-message secret; the target checks both (issue 33).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxAm {
    /// Echoed in the reply.
    pub token: u64,
    pub write: bool,
    pub op: VecOp,
    /// The session's active-message secret (derived from its handshake on both sides).
    pub secret: [u8; 16],
}

impl UcxAm {
    /// The AM header and the descriptor (the head of the AM data; a WRITE's bytes follow it).
    /// Fails, sending nothing, when a piece's length or count does not fit its wire field.
    pub fn encode(&self) -> Result<([u8; UCX_AM_REQ_HEADER], Vec<u8>), EncodeError> {
        let body = if self.write { Body::WriteVReq(self.op.clone()) } else { Body::ReadVReq(self.op.clone()) }.try_encode(0)?;
        let desc = body[HEADER_LEN..].to_vec();
        let mut h = [0u8; UCX_AM_REQ_HEADER];
        h[0] = if self.write { 2 } else { 1 };
        h[1..9].copy_from_slice(&self.token.to_le_bytes());
        h[9..13].copy_from_slice(&fit32("descriptor length", desc.len() as u64)?.to_le_bytes());
        h[13..29].copy_from_slice(&self.secret);
        Ok((h, desc))
    }

    /// Decode a received request: `header` and the whole AM `data`. Checks everything a
    /// `ReadVReq`/`WriteVReq` body is checked for, and that the data after the descriptor is
    /// exactly the pieces' bytes (a WRITE) or empty (a READ). Returns the request and its
    /// payload. Region bounds and access are the target's to check.
    pub fn decode<'a>(header: &[u8], data: &'a [u8]) -> Result<(UcxAm, &'a [u8]), DecodeError> {
        if header.len() != UCX_AM_REQ_HEADER {
            return Err(DecodeError::Malformed("ucx active-message header of the wrong size"));
        }
        let write = match header[0] {
            1 => false,
            2 => true,
            _ => return Err(DecodeError::Malformed("ucx active message of an unknown op")),
        };
        let token = u64::from_le_bytes(header[1..9].try_into().expect("8 bytes"));
        let desc_len = u32::from_le_bytes(header[9..13].try_into().expect("4 bytes")) as usize;
        let secret: [u8; 16] = header[13..29].try_into().expect("16 bytes");
        if desc_len > UCX_AM_DESC_MAX {
            return Err(DecodeError::TooMany { what: "ucx piece descriptor bytes", n: desc_len as u64, max: UCX_AM_DESC_MAX as u64 });
        }
        if desc_len > data.len() {
            return Err(DecodeError::Truncated { need: desc_len, have: data.len() });
        }
        let (desc, payload) = data.split_at(desc_len);
        let mut r = Reader::new(desc);
        let op = decode_vec(&mut r)?;
        r.finish()?;
        let want = if write { op.total() } else { 0 };
        if payload.len() as u64 != want {
            return Err(DecodeError::Malformed("ucx active-message data is not the pieces' bytes"));
        }
        Ok((UcxAm { token, write, op, secret }, payload))
    }
}

/// The header of a [`UcxAm`]'s reply; a READ's reply carries the pieces' bytes as its data.
pub fn encode_ucx_am_reply(token: u64, status: Status, secret: &[u8; 16]) -> [u8; UCX_AM_REPLY_HEADER] {
    let mut h = [0u8; UCX_AM_REPLY_HEADER];
    h[..8].copy_from_slice(&token.to_le_bytes());
    h[8..10].copy_from_slice(&(status as u16).to_le_bytes());
    h[10..].copy_from_slice(secret);
    h
}

/// `(token, status, secret)` of a reply header.
pub fn decode_ucx_am_reply(header: &[u8]) -> Result<(u64, Status, [u8; 16]), DecodeError> {
    if header.len() != UCX_AM_REPLY_HEADER {
        return Err(DecodeError::Malformed("ucx active-message reply header of the wrong size"));
    }
    let token = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    let secret: [u8; 16] = header[10..].try_into().expect("16 bytes");
    Ok((token, Status::from_u16(u16::from_le_bytes([header[8], header[9]])), secret))
}

/// The tail of `UcxOpen`/`UcxReady`: the feature word (absent: a peer before `Hello` version
/// 3, i.e. 0) and the MAC (absent: a peer from before issue 33). Nothing, 4 or 36 bytes;
/// anything else is malformed.
fn ucx_tail(r: &mut Reader<'_>) -> Result<(u32, Option<[u8; 32]>), DecodeError> {
    match r.remaining() {
        0 => Ok((0, None)),
        4 => Ok((r.u32()?, None)),
        36 => Ok((r.u32()?, Some(r.array()?))),
        _ => Err(DecodeError::Malformed("ucx session tail is not a feature word and a MAC")),
    }
}

/// Write the tail `ucx_tail` reads (canonical: the feature word only when not 0 or followed
/// by a MAC).
fn put_ucx_tail(out: &mut Vec<u8>, features: u32, mac: &Option<[u8; 32]>) {
    if features != 0 || mac.is_some() {
        out.extend_from_slice(&features.to_le_bytes());
    }
    if let Some(m) = mac {
        out.extend_from_slice(m);
    }
}

/// The body of a vectored request. Every entry is checked for shape here (a length and a
/// count of at least 1, a stride for a count over 1 that keeps the pieces from overlapping)
/// and the totals against the bounds, before anything is allocated for more than the entries
/// the body holds; the target checks each entry against its region before forming a pointer.
fn decode_vec(r: &mut Reader<'_>) -> Result<VecOp, DecodeError> {
    let region = r.u64()?;
    let key = RegionKey(r.array()?);
    let n = r.u32()? as usize;
    if n > MAX_VEC_ENTRIES {
        return Err(DecodeError::TooMany { what: "vectored request entries", n: n as u64, max: MAX_VEC_ENTRIES as u64 });
    }
    if n == 0 {
        return Err(DecodeError::Malformed("vectored request with no pieces"));
    }
    let mut pieces = Vec::with_capacity(n.min(r.remaining() / 16));
    let (mut bytes, mut count) = (0u64, 0u64);
    for _ in 0..n {
        let offset = r.u64()?;
        let len = r.u32()? as u64;
        let k = r.u32()? as u64;
        if len == 0 || k == 0 {
            return Err(DecodeError::Malformed("vectored piece of no bytes"));
        }
        let stride = if k == 1 { 0 } else { r.u64()? };
        if k > 1 && stride < len {
            return Err(DecodeError::Malformed("strided pieces overlap"));
        }
        count += k;
        if count > MAX_VEC_PIECES {
            return Err(DecodeError::TooMany { what: "pieces in one request", n: count, max: MAX_VEC_PIECES });
        }
        // count <= 2^20 and len < 2^32: no overflow.
        bytes += len * k;
        if bytes > MAX_CHUNK {
            return Err(DecodeError::TooMany { what: "bytes in one request", n: bytes, max: MAX_CHUNK });
        }
        let p = VecPiece { offset, len, count: k, stride };
        if p.end().is_none() {
            return Err(DecodeError::Malformed("vectored piece past the end of the address space"));
        }
        pieces.push(p);
    }
    Ok(VecOp { region, key, pieces })
}

/// A u32-length-prefixed byte string.
fn put_blob32(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// A u32-length-prefixed byte string of at most `max` bytes (checked before anything is copied).
fn blob32(r: &mut Reader<'_>, what: &'static str, max: usize) -> Result<Vec<u8>, DecodeError> {
    let n = r.u32()? as usize;
    if n > max {
        return Err(DecodeError::TooMany { what, n: n as u64, max: max as u64 });
    }
    Ok(r.bytes(n)?.to_vec())
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(b: Body) {
        let bytes = b.encode(42);
        let h = Header::decode(bytes[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.req_id, 42);
        assert_eq!(h.body_len as usize, bytes.len() - HEADER_LEN);
        assert_eq!(Body::decode(h.kind, &bytes[HEADER_LEN..]).unwrap(), b);
    }

    #[test]
    fn every_kind_round_trips() {
        let op = RemoteOp { region: 7, key: RegionKey([9; 16]), offset: 4096, len: 1 << 20 };
        roundtrip(Body::Hello { version: HELLO_VERSION, role: Role::Data, incarnation: 5, name: "prefill-0".into(), nonce: [3; 16] });
        roundtrip(Body::Challenge { auth_required: true, incarnation: 1, nonce: [1; 16], name: "decode".into() });
        roundtrip(Body::Auth { mac: [2; 32] });
        roundtrip(Body::Welcome { mac: [4; 32] });
        roundtrip(Body::ReadReq(op));
        roundtrip(Body::WriteReq(op));
        roundtrip(Body::Notif(b"done".to_vec()));
        roundtrip(Body::NotifSeq { incarnation: 7, seq: 9, msg: b"done".to_vec() });
        roundtrip(Body::NotifSeq { incarnation: 7, seq: 10, msg: Vec::new() });
        roundtrip(Body::Ping);
        roundtrip(Body::Fence(vec![]));
        roundtrip(Body::Fence(vec![[7; 16], [8; 16]]));
        roundtrip(Body::Resp { status: Status::BadKey, bulk_len: 0, msg: "bad key".into() });
        roundtrip(Body::MetaGet);
        roundtrip(Body::Meta(vec![1, 2, 3]));
        roundtrip(Body::IpcReq { host: [5; 16], watch: [4; 16], regions: vec![(1, RegionKey([6; 16])), (9, RegionKey([7; 16]))] });
        roundtrip(Body::IpcHandles(vec![IpcEntry {
            region: 3,
            device: 1,
            uuid: [2; 16],
            handle: [8; 64],
            offset: 4096,
            alloc_len: 1 << 21,
        }]));
        roundtrip(Body::IpcRevoke(vec![]));
        roundtrip(Body::IpcRevoke(vec![3, u64::MAX]));
        roundtrip(Body::IpcReleased(vec![3]));
        roundtrip(Body::Hello { version: HELLO_VERSION, role: Role::IpcWatch, incarnation: 5, name: "prefill-0".into(), nonce: [3; 16] });
        roundtrip(Body::IpcHandles(vec![]));
        roundtrip(Body::MetaPut(vec![]));
        roundtrip(Body::Error { status: Status::VersionMismatch, msg: "v2".into() });
        roundtrip(Body::Hello { version: HELLO_VERSION, role: Role::UcxSession, incarnation: 5, name: "prefill-0".into(), nonce: [3; 16] });
        roundtrip(Body::UcxOpen { rail: 3, addr: vec![7; 300], features: 0, mac: None });
        roundtrip(Body::UcxOpen { rail: 3, addr: vec![7; 300], features: UCX_FEATURE_AM, mac: None });
        roundtrip(Body::UcxOpen { rail: 3, addr: vec![7; 300], features: 0, mac: Some([9; 32]) });
        roundtrip(Body::UcxOpen { rail: 3, addr: vec![7; 300], features: UCX_FEATURE_AM, mac: Some([9; 32]) });
        roundtrip(Body::UcxReady { addr: vec![1; 200], regions: vec![], features: 0, mac: None });
        roundtrip(Body::UcxReady { addr: vec![1; 200], regions: vec![], features: UCX_FEATURE_AM, mac: None });
        roundtrip(Body::UcxReady { addr: vec![1; 200], regions: vec![], features: 0, mac: Some([3; 32]) });
        roundtrip(Body::UcxReady {
            addr: vec![],
            regions: vec![
                UcxRegion { id: 1, base: 0x7f00_0000_0000, len: 1 << 20, rkey: vec![5; 40] },
                UcxRegion { id: 9, base: 4096, len: 1, rkey: vec![] },
            ],
            features: 0,
            mac: Some([1; 32]),
        });
        roundtrip(Body::UcxRkeys(vec![]));
        roundtrip(Body::UcxRkeys(vec![1, u64::MAX]));
    }

    #[test]
    fn vectored_requests_round_trip_and_are_bounded() {
        let key = RegionKey([5; 16]);
        let pieces = vec![
            VecPiece { offset: 0, len: 4096, count: 1, stride: 0 },
            VecPiece { offset: 1 << 20, len: 8192, count: 100, stride: 16384 },
        ];
        let op = VecOp { region: 3, key, pieces };
        assert_eq!(op.total(), 4096 + 819200);
        roundtrip(Body::ReadVReq(op.clone()));
        roundtrip(Body::WriteVReq(op.clone()));
        // An old peer's Hello (version 1) is still understood, so is 3 (ucx features); 4 is not.
        roundtrip(Body::Hello { version: 1, role: Role::Data, incarnation: 1, name: "old".into(), nonce: [0; 16] });
        roundtrip(Body::Hello { version: HELLO_UCX_FEATURES, role: Role::UcxSession, incarnation: 1, name: "u".into(), nonce: [0; 16] });
        let v3 = Body::Hello { version: HELLO_MAX + 1, role: Role::Data, incarnation: 1, name: "new".into(), nonce: [0; 16] }.encode(0);
        assert!(matches!(Body::decode(Kind::Hello, &v3[HEADER_LEN..]), Err(DecodeError::VersionMismatch { .. })));
        // Every truncation and a trailing byte are refused.
        let bytes = Body::WriteVReq(op.clone()).encode(0);
        let body = &bytes[HEADER_LEN..];
        for cut in 0..body.len() {
            assert!(Body::decode(Kind::WriteVReq, &body[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(Body::decode(Kind::WriteVReq, &long).is_err());
        let dec = |pieces: Vec<VecPiece>| {
            let b = Body::ReadVReq(VecOp { region: 1, key, pieces }).encode(0);
            Body::decode(Kind::ReadVReq, &b[HEADER_LEN..])
        };
        // Empty lists, empty pieces, overlapping strides, overflowing ends.
        assert!(matches!(dec(vec![]), Err(DecodeError::Malformed(_))));
        assert!(matches!(dec(vec![VecPiece { offset: 0, len: 0, count: 1, stride: 0 }]), Err(DecodeError::Malformed(_))));
        assert!(matches!(dec(vec![VecPiece { offset: 0, len: 8, count: 0, stride: 8 }]), Err(DecodeError::Malformed(_))));
        assert!(matches!(dec(vec![VecPiece { offset: 0, len: 8, count: 2, stride: 4 }]), Err(DecodeError::Malformed(_))));
        assert!(matches!(dec(vec![VecPiece { offset: u64::MAX - 4, len: 8, count: 1, stride: 0 }]), Err(DecodeError::Malformed(_))));
        assert!(matches!(dec(vec![VecPiece { offset: 0, len: 8, count: 3, stride: u64::MAX / 2 }]), Err(DecodeError::Malformed(_))));
        // Over the byte, piece and entry bounds.
        let big = VecPiece { offset: 0, len: 1 << 20, count: 65, stride: 1 << 20 };
        assert!(matches!(dec(vec![big]), Err(DecodeError::TooMany { .. })));
        let tiny = VecPiece { offset: 0, len: 1, count: MAX_VEC_PIECES + 1, stride: 1 };
        assert!(matches!(dec(vec![tiny]), Err(DecodeError::TooMany { .. })));
        let one = VecPiece { offset: 0, len: 1, count: 1, stride: 0 };
        let full = Body::ReadVReq(VecOp { region: 1, key, pieces: vec![one; MAX_VEC_ENTRIES] }).encode(0);
        assert!(Body::decode(Kind::ReadVReq, &full[HEADER_LEN..]).is_ok());
        let mut over = 1u64.to_le_bytes().to_vec();
        over.extend([0u8; 16]);
        over.extend(((MAX_VEC_ENTRIES + 1) as u32).to_le_bytes());
        assert!(matches!(Body::decode(Kind::ReadVReq, &over), Err(DecodeError::TooMany { .. })));
        // A count that promises more entries than the body holds.
        let mut short = 1u64.to_le_bytes().to_vec();
        short.extend([0u8; 16]);
        short.extend(1000u32.to_le_bytes());
        short.extend([1u8; 16]);
        assert!(matches!(Body::decode(Kind::ReadVReq, &short), Err(DecodeError::Truncated { .. })));
        // The largest body (every entry strided) fits the kind's bound.
        let s = VecPiece { offset: 0, len: 1, count: 2, stride: 1 };
        let widest = Body::WriteVReq(VecOp { region: 1, key, pieces: vec![s; MAX_VEC_ENTRIES] }).encode(0);
        assert_eq!(widest.len() - HEADER_LEN, Kind::WriteVReq.max_body());
    }

    #[test]
    fn oversized_fields_are_refused_not_truncated() {
        // A piece of 4 GiB + 1 used to be written as a 1-byte piece (`as u32`): a frame that
        // decodes to another request. Now every field that does not fit is a typed error.
        let key = RegionKey([1; 16]);
        let piece = |len: u64, count: u64| VecPiece { offset: 0, len, count, stride: if count == 1 { 0 } else { len } };
        let over = (u32::MAX as u64) + 2; // 4 GiB + 1
        for (what, p) in [("vectored piece length", piece(over, 1)), ("vectored piece count", piece(1, over))] {
            for body in
                [Body::ReadVReq(VecOp { region: 1, key, pieces: vec![p] }), Body::WriteVReq(VecOp { region: 1, key, pieces: vec![p] })]
            {
                assert_eq!(body.try_encode(7), Err(EncodeError::TooLarge { what, n: over, max: u32::MAX as u64 }));
            }
            let am = UcxAm { token: 1, write: true, op: VecOp { region: 1, key, pieces: vec![p] }, secret: [0; 16] };
            assert!(matches!(am.encode(), Err(EncodeError::TooLarge { .. })));
        }
        // The largest value that fits is encoded exactly (the decoder then applies its bounds).
        let edge = Body::ReadVReq(VecOp { region: 1, key, pieces: vec![piece(u32::MAX as u64, 1)] }).try_encode(7).unwrap();
        assert_eq!(u32::from_le_bytes(edge[HEADER_LEN + 36..HEADER_LEN + 40].try_into().unwrap()), u32::MAX);
        assert!(matches!(Body::decode(Kind::ReadVReq, &edge[HEADER_LEN..]), Err(DecodeError::TooMany { .. })));
        // `encode` refuses loudly rather than truncating.
        let caught = std::panic::catch_unwind(|| Body::ReadVReq(VecOp { region: 1, key, pieces: vec![piece(over, 1)] }).encode(0));
        assert!(caught.is_err());
    }

    #[test]
    fn ucx_bodies_are_bounded() {
        // Lengths over their bounds are refused before anything is copied.
        let mut open = 0u16.to_le_bytes().to_vec();
        open.extend(((MAX_UCX_ADDR + 1) as u32).to_le_bytes());
        assert!(matches!(Body::decode(Kind::UcxOpen, &open), Err(DecodeError::TooMany { .. })));
        let mut ready = 0u32.to_le_bytes().to_vec();
        ready.extend(1u32.to_le_bytes());
        ready.extend([0u8; 24]);
        ready.extend(((MAX_UCX_RKEY + 1) as u16).to_le_bytes());
        ready.resize(ready.len() + MAX_UCX_RKEY + 1, 0);
        assert!(matches!(Body::decode(Kind::UcxReady, &ready), Err(DecodeError::TooMany { .. })));
        // A region count that promises more than the body holds.
        let mut many = 0u32.to_le_bytes().to_vec();
        many.extend(1000u32.to_le_bytes());
        many.extend([0u8; 26]);
        assert!(matches!(Body::decode(Kind::UcxReady, &many), Err(DecodeError::Truncated { .. })));
        let mut over = 0u32.to_le_bytes().to_vec();
        over.extend(((MAX_UCX_REGIONS + 1) as u32).to_le_bytes());
        assert!(matches!(Body::decode(Kind::UcxReady, &over), Err(DecodeError::TooMany { .. })));
        let mut ids = ((MAX_UCX_RKEYS + 1) as u32).to_le_bytes().to_vec();
        ids.resize(ids.len() + 8 * (MAX_UCX_RKEYS + 1), 0);
        assert!(Body::decode(Kind::UcxRkeys, &ids).is_err());
        // Truncated and trailing bodies.
        let ok = Body::UcxReady {
            addr: vec![1; 9],
            regions: vec![UcxRegion { id: 1, base: 2, len: 3, rkey: vec![4; 5] }],
            features: 0,
            mac: None,
        }
        .encode(0);
        let body = &ok[HEADER_LEN..];
        for cut in 0..body.len() {
            assert!(Body::decode(Kind::UcxReady, &body[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(Body::decode(Kind::UcxReady, &long).is_err());
        // An unknown role byte.
        let mut hello =
            Body::Hello { version: HELLO_VERSION, role: Role::UcxSession, incarnation: 0, name: "a".into(), nonce: [0; 16] }.encode(0);
        hello[HEADER_LEN + 2] = 5;
        assert_eq!(Body::decode(Kind::Hello, &hello[HEADER_LEN..]), Err(DecodeError::Malformed("unknown role")));
    }

    #[test]
    fn ucx_ready_encoding_stays_within_its_bound() {
        // Oversized rkeys are left out, never truncated; past the body bound regions are dropped.
        let big = UcxRegion { id: 1, base: 0, len: 1, rkey: vec![0; MAX_UCX_RKEY + 1] };
        let fits = UcxRegion { id: 2, base: 0, len: 1, rkey: vec![0; MAX_UCX_RKEY] };
        let regions: Vec<UcxRegion> = std::iter::once(big).chain((0..2000).map(|i| UcxRegion { id: i + 2, ..fits.clone() })).collect();
        let bytes = Body::UcxReady { addr: vec![0; MAX_UCX_ADDR], regions, features: UCX_FEATURE_AM, mac: Some([0; 32]) }.encode(0);
        assert!(bytes.len() - HEADER_LEN <= Kind::UcxReady.max_body());
        let h = Header::decode(bytes[..HEADER_LEN].try_into().unwrap()).unwrap();
        let Body::UcxReady { regions, .. } = Body::decode(h.kind, &bytes[HEADER_LEN..]).unwrap() else { panic!("not UcxReady") };
        assert!(!regions.is_empty() && regions.len() < 2000);
        assert!(regions.iter().all(|g| g.rkey.len() == MAX_UCX_RKEY && g.id >= 2));
    }

    #[test]
    fn header_rejects_bad_magic_version_kind_and_size() {
        let mut h = Body::Ping.encode(1)[..HEADER_LEN].try_into().unwrap();
        assert!(Header::decode(&h).is_ok());
        let mut bad = h;
        bad[0] = b'X';
        assert!(matches!(Header::decode(&bad), Err(DecodeError::BadMagic(_))));
        let mut bad = h;
        bad[2] = 9;
        assert_eq!(Header::decode(&bad), Err(DecodeError::VersionMismatch { got: 9, want: VERSION }));
        let mut bad = h;
        bad[3] = 99;
        assert_eq!(Header::decode(&bad), Err(DecodeError::UnknownKind(99)));
        // A ReadReq claiming a 4 GiB body is refused from the header alone.
        h[3] = Kind::ReadReq as u8;
        h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Header::decode(&h), Err(DecodeError::BodyTooLarge { .. })));
    }

    #[test]
    fn truncated_and_trailing_bodies_are_refused() {
        let bytes = Body::ReadReq(RemoteOp { region: 1, key: RegionKey([0; 16]), offset: 0, len: 8 }).encode(0);
        let body = &bytes[HEADER_LEN..];
        for cut in 0..body.len() {
            assert!(Body::decode(Kind::ReadReq, &body[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(Body::decode(Kind::ReadReq, &long).is_err());
    }

    #[test]
    fn oversized_request_len_is_refused() {
        let op = RemoteOp { region: 1, key: RegionKey([0; 16]), offset: 0, len: MAX_CHUNK + 1 };
        let bytes = Body::WriteReq(op).encode(0);
        assert!(matches!(Body::decode(Kind::WriteReq, &bytes[HEADER_LEN..]), Err(DecodeError::TooMany { .. })));
    }

    #[test]
    fn ipc_bodies_are_bounded() {
        // Revocation lists: a count over the bound is refused before anything is read, a count
        // promising more ids than the body holds is truncated, trailing bytes are refused.
        for kind in [Kind::IpcRevoke, Kind::IpcReleased] {
            let over = ((MAX_IPC_REVOKE + 1) as u16).to_le_bytes().to_vec();
            assert!(matches!(Body::decode(kind, &over), Err(DecodeError::TooMany { .. })));
            let mut big = over.clone();
            big.resize(big.len() + 8 * (MAX_IPC_REVOKE + 1), 0);
            assert!(matches!(Body::decode(kind, &big), Err(DecodeError::BodyTooLarge { .. })));
            let mut short = 3u16.to_le_bytes().to_vec();
            short.extend([0u8; 16]);
            assert!(matches!(Body::decode(kind, &short), Err(DecodeError::Truncated { .. })));
            let mut long = 1u16.to_le_bytes().to_vec();
            long.extend([0u8; 9]);
            assert!(Body::decode(kind, &long).is_err());
            // The encoder never writes more than the bound.
            let bytes = Body::IpcRevoke((0..5000).collect()).encode(0);
            assert_eq!(bytes.len() - HEADER_LEN, Kind::IpcRevoke.max_body());
        }
        // Every truncation of an IpcReq and an IpcHandles answer is refused.
        let req = Body::IpcReq { host: [1; 16], watch: [2; 16], regions: vec![(3, RegionKey([4; 16]))] }.encode(0);
        let entry = IpcEntry { region: 1, device: 0, uuid: [5; 16], handle: [6; 64], offset: 7, alloc_len: 8 };
        let handles = Body::IpcHandles(vec![entry]).encode(0);
        for (kind, bytes) in [(Kind::IpcReq, &req), (Kind::IpcHandles, &handles)] {
            let body = &bytes[HEADER_LEN..];
            assert!(body.len() <= kind.max_body());
            for cut in 0..body.len() {
                assert!(Body::decode(kind, &body[..cut]).is_err(), "{kind:?} cut at {cut}");
            }
        }
        // The largest answer fits its kind's bound exactly.
        let full = Body::IpcHandles(vec![entry; MAX_IPC_REGIONS]).encode(0);
        assert_eq!(full.len() - HEADER_LEN, Kind::IpcHandles.max_body());
    }

    #[test]
    fn fence_count_is_bounded() {
        let mut body = ((MAX_FENCE + 1) as u16).to_le_bytes().to_vec();
        body.resize(body.len() + 16 * (MAX_FENCE + 1), 0);
        assert!(Body::decode(Kind::Fence, &body).is_err());
        // A count that promises more ids than the body holds is truncated, not trusted.
        let mut short = 3u16.to_le_bytes().to_vec();
        short.extend([0u8; 32]);
        assert!(Body::decode(Kind::Fence, &short).is_err());
    }

    #[test]
    fn garbage_never_panics() {
        // A cheap deterministic sweep; the cargo-fuzz targets go further.
        let mut x: u64 = 0x9E3779B97F4A7C15;
        for _ in 0..20000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 80) as usize;
            let bytes: Vec<u8> = (0..n).map(|i| (x >> (i % 8 * 8)) as u8 ^ i as u8).collect();
            for k in [1u8, 2, 3, 4, 10, 11, 15, 16, 12, 13, 14, 20, 30, 31, 32, 40, 50, 51, 52, 53, 54, 55, 56] {
                let _ = Body::decode(Kind::from_u8(k).unwrap(), &bytes);
            }
            if bytes.len() >= HEADER_LEN {
                let _ = Header::decode(bytes[..HEADER_LEN].try_into().unwrap());
            }
        }
    }

    #[test]
    fn ucx_am_roundtrip_and_refusals() {
        let op = VecOp {
            region: 7,
            key: RegionKey([0; 16]),
            pieces: vec![VecPiece { offset: 8192, len: 4096, count: 1, stride: 0 }, VecPiece { offset: 0, len: 16, count: 3, stride: 64 }],
        };
        let total = op.total() as usize;
        for write in [false, true] {
            let am = UcxAm { token: 0x1234_5678_9abc, write, op: op.clone(), secret: [0x5e; 16] };
            let (h, desc) = am.encode().expect("fits");
            let mut data = desc.clone();
            if write {
                data.extend(std::iter::repeat_n(0xa5, total));
            }
            let (back, payload) = UcxAm::decode(&h, &data).unwrap();
            assert_eq!(back, am);
            assert_eq!(payload.len(), if write { total } else { 0 });
            // Payload one byte short or long, descriptor cut anywhere, a header of another size.
            let mut short = data.clone();
            short.pop();
            assert!(UcxAm::decode(&h, &short).is_err());
            let mut long = data.clone();
            long.push(0);
            assert!(UcxAm::decode(&h, &long).is_err());
            for cut in 0..desc.len() {
                assert!(UcxAm::decode(&h, &data[..cut]).is_err(), "cut at {cut}");
            }
            assert!(UcxAm::decode(&h[..UCX_AM_REQ_HEADER - 1], &data).is_err());
        }
        // Unknown op, a descriptor length past the bound, a piece list over the entry bound.
        let (mut h, desc) = UcxAm { token: 1, write: false, op: op.clone(), secret: [0; 16] }.encode().expect("fits");
        h[0] = 3;
        assert!(matches!(UcxAm::decode(&h, &desc), Err(DecodeError::Malformed(_))));
        h[0] = 1;
        h[9..13].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(UcxAm::decode(&h, &desc), Err(DecodeError::TooMany { .. })));
        let many = VecOp { pieces: vec![VecPiece { offset: 0, len: 1, count: 1, stride: 0 }; MAX_VEC_ENTRIES + 1], ..op.clone() };
        let (h, desc) = UcxAm { token: 1, write: false, op: many, secret: [0; 16] }.encode().expect("fits");
        assert!(matches!(UcxAm::decode(&h, &desc), Err(DecodeError::TooMany { .. })));
        // A zero-length piece.
        let zero = VecOp { pieces: vec![VecPiece { offset: 0, len: 0, count: 1, stride: 0 }], ..op };
        let (h, desc) = UcxAm { token: 1, write: false, op: zero, secret: [0; 16] }.encode().expect("fits");
        assert!(matches!(UcxAm::decode(&h, &desc), Err(DecodeError::Malformed(_))));
        // Replies.
        let r = encode_ucx_am_reply(99, Status::OutOfBounds, &[7; 16]);
        assert_eq!(decode_ucx_am_reply(&r).unwrap(), (99, Status::OutOfBounds, [7; 16]));
        assert!(decode_ucx_am_reply(&r[..UCX_AM_REPLY_HEADER - 1]).is_err());
    }

    #[test]
    fn ucx_features_word_is_optional_and_exact() {
        let open = Body::UcxOpen { rail: 1, addr: vec![1; 4], features: 0, mac: None }.encode(0);
        let body = &open[HEADER_LEN..];
        assert_eq!(body.len(), 2 + 4 + 4, "no feature word when none is offered");
        let mut with = body.to_vec();
        with.extend_from_slice(&UCX_FEATURE_AM.to_le_bytes());
        assert_eq!(
            Body::decode(Kind::UcxOpen, &with).unwrap(),
            Body::UcxOpen { rail: 1, addr: vec![1; 4], features: UCX_FEATURE_AM, mac: None }
        );
        with.extend_from_slice(&[6; 32]);
        assert_eq!(
            Body::decode(Kind::UcxOpen, &with).unwrap(),
            Body::UcxOpen { rail: 1, addr: vec![1; 4], features: UCX_FEATURE_AM, mac: Some([6; 32]) }
        );
        let sealed = Body::UcxOpen { rail: 1, addr: vec![1; 4], features: 0, mac: Some([6; 32]) }.encode(0);
        assert_eq!(sealed.len() - HEADER_LEN, 2 + 4 + 4 + 4 + 32, "a MAC comes after the feature word, always sent then");
        for extra in [1usize, 2, 3, 5, 32, 35, 37] {
            let mut bad = body.to_vec();
            bad.extend(std::iter::repeat_n(0, extra));
            assert!(Body::decode(Kind::UcxOpen, &bad).is_err(), "{extra} trailing bytes");
        }
    }
}
