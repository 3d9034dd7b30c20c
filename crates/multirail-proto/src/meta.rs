//! Agent metadata and descriptor lists as explicit, versioned binary schemas.
//!
//! Both blobs start with a 4-byte magic and a u16 schema version; every count is bounded and
//! checked against the bytes actually present before anything is allocated. No pickle.

use crate::codec::DecodeError;
use crate::reader::{put_str16, Reader};

pub const META_MAGIC: [u8; 4] = *b"MRMD";
pub const DESC_MAGIC: [u8; 4] = *b"MRDL";
pub const META_VERSION: u16 = 1;
pub const MAX_REGIONS: usize = 1 << 16;
pub const MAX_RAILS: usize = 64;
pub const MAX_DESCS: usize = 1 << 24;

/// The unguessable capability that lets a peer touch a region (128 random bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionKey(pub [u8; 16]);

impl std::fmt::Debug for RegionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keys are secrets: never print them whole.
        write!(f, "RegionKey({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}

impl RegionKey {
    /// Constant-time comparison, so response timing reveals nothing about a key.
    pub fn ct_eq(&self, other: &RegionKey) -> bool {
        self.0.iter().zip(other.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// What a remote peer may do with a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Access {
    /// Not exported: local use only, never in metadata.
    Local = 0,
    ReadOnly = 1,
    ReadWrite = 2,
}

impl Access {
    fn from_u8(v: u8) -> Result<Access, DecodeError> {
        Ok(match v {
            0 => Access::Local,
            1 => Access::ReadOnly,
            2 => Access::ReadWrite,
            _ => return Err(DecodeError::Malformed("unknown access")),
        })
    }
}

/// Memory kind, as NIXL names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MemType {
    Dram = 0,
    Vram = 1,
}

impl MemType {
    fn from_u8(v: u8) -> Result<MemType, DecodeError> {
        Ok(match v {
            0 => MemType::Dram,
            1 => MemType::Vram,
            _ => return Err(DecodeError::Malformed("unknown memory type")),
        })
    }
}

/// One exported region as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionMeta {
    pub id: u64,
    pub base: u64,
    pub len: u64,
    pub dev: u32,
    pub mem: MemType,
    pub access: Access,
    pub key: RegionKey,
}

/// One rail of an agent: where its data listener is and what the link is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailInfo {
    /// Interface name ("eth1"), or a label.
    pub name: String,
    /// IPv4/IPv6 address in text form.
    pub addr: String,
    pub prefix_len: u8,
    /// Port of the data listener on this rail.
    pub port: u16,
    /// Link speed in Mbit/s, 0 when unknown.
    pub speed_mbps: u64,
    pub mtu: u32,
    /// NUMA node, -1 when unknown.
    pub numa: i32,
    /// RDMA device behind the interface, empty when none.
    pub rdma_dev: String,
}

/// Everything a peer needs to reach an agent and address its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMeta {
    pub name: String,
    /// Random per process start; a restarted agent has a new one, so stale metadata is detected.
    pub incarnation: u64,
    pub rails: Vec<RailInfo>,
    pub regions: Vec<RegionMeta>,
}

const REGION_BYTES: usize = 8 + 8 + 8 + 4 + 1 + 1 + 16;
const RAIL_MIN_BYTES: usize = 2 + 2 + 1 + 2 + 8 + 4 + 4 + 2;

impl AgentMeta {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.regions.len() * REGION_BYTES);
        out.extend_from_slice(&META_MAGIC);
        out.extend_from_slice(&META_VERSION.to_le_bytes());
        put_str16(&mut out, &self.name);
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        out.extend_from_slice(&(self.rails.len() as u32).to_le_bytes());
        for r in &self.rails {
            put_str16(&mut out, &r.name);
            put_str16(&mut out, &r.addr);
            out.push(r.prefix_len);
            out.extend_from_slice(&r.port.to_le_bytes());
            out.extend_from_slice(&r.speed_mbps.to_le_bytes());
            out.extend_from_slice(&r.mtu.to_le_bytes());
            out.extend_from_slice(&r.numa.to_le_bytes());
            put_str16(&mut out, &r.rdma_dev);
        }
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for g in &self.regions {
            out.extend_from_slice(&g.id.to_le_bytes());
            out.extend_from_slice(&g.base.to_le_bytes());
            out.extend_from_slice(&g.len.to_le_bytes());
            out.extend_from_slice(&g.dev.to_le_bytes());
            out.push(g.mem as u8);
            out.push(g.access as u8);
            out.extend_from_slice(&g.key.0);
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<AgentMeta, DecodeError> {
        let mut r = Reader::new(buf);
        if r.array::<4>()? != META_MAGIC {
            return Err(DecodeError::Malformed("not multirail metadata (bad magic)"));
        }
        let v = r.u16()?;
        if v != META_VERSION {
            return Err(DecodeError::VersionMismatch { got: v.min(255) as u8, want: META_VERSION as u8 });
        }
        let name = r.str16("name bytes", crate::codec::MAX_NAME)?;
        let incarnation = r.u64()?;
        let n = r.count("rails", MAX_RAILS, RAIL_MIN_BYTES)?;
        let mut rails = Vec::with_capacity(n);
        for _ in 0..n {
            rails.push(RailInfo {
                name: r.str16("rail name bytes", 64)?,
                addr: r.str16("address bytes", 64)?,
                prefix_len: r.u8()?,
                port: r.u16()?,
                speed_mbps: r.u64()?,
                mtu: r.u32()?,
                numa: r.u32()? as i32,
                rdma_dev: r.str16("rdma device bytes", 64)?,
            });
        }
        let n = r.count("regions", MAX_REGIONS, REGION_BYTES)?;
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64()?;
            let base = r.u64()?;
            let len = r.u64()?;
            if base.checked_add(len).is_none() {
                return Err(DecodeError::Malformed("region wraps the address space"));
            }
            regions.push(RegionMeta {
                id,
                base,
                len,
                dev: r.u32()?,
                mem: MemType::from_u8(r.u8()?)?,
                access: Access::from_u8(r.u8()?)?,
                key: RegionKey(r.array()?),
            });
        }
        r.finish()?;
        // A region id names one region: with two, which one a transfer meant is a guess.
        let mut ids: Vec<u64> = regions.iter().map(|m| m.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(DecodeError::Malformed("metadata lists a region id twice"));
        }
        Ok(AgentMeta { name, incarnation, rails, regions })
    }
}

/// A list of (address, length, device) descriptors of one memory type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescList {
    pub mem: MemType,
    pub descs: Vec<(u64, u64, u32)>,
}

const DESC_BYTES: usize = 8 + 8 + 4;

impl DescList {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(11 + self.descs.len() * DESC_BYTES);
        out.extend_from_slice(&DESC_MAGIC);
        out.extend_from_slice(&META_VERSION.to_le_bytes());
        out.push(self.mem as u8);
        out.extend_from_slice(&(self.descs.len() as u32).to_le_bytes());
        for (a, l, d) in &self.descs {
            out.extend_from_slice(&a.to_le_bytes());
            out.extend_from_slice(&l.to_le_bytes());
            out.extend_from_slice(&d.to_le_bytes());
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<DescList, DecodeError> {
        let mut r = Reader::new(buf);
        if r.array::<4>()? != DESC_MAGIC {
            return Err(DecodeError::Malformed("not a multirail descriptor list (bad magic)"));
        }
        let v = r.u16()?;
        if v != META_VERSION {
            return Err(DecodeError::VersionMismatch { got: v.min(255) as u8, want: META_VERSION as u8 });
        }
        let mem = MemType::from_u8(r.u8()?)?;
        let n = r.count("descriptors", MAX_DESCS, DESC_BYTES)?;
        let mut descs = Vec::with_capacity(n);
        for _ in 0..n {
            let a = r.u64()?;
            let l = r.u64()?;
            if a.checked_add(l).is_none() {
                return Err(DecodeError::Malformed("descriptor wraps the address space"));
            }
            descs.push((a, l, r.u32()?));
        }
        r.finish()?;
        Ok(DescList { mem, descs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMeta {
        AgentMeta {
            name: "decode-3".into(),
            incarnation: 0xdead_beef,
            rails: vec![RailInfo {
                name: "eth1".into(),
                addr: "10.0.1.2".into(),
                prefix_len: 24,
                port: 5555,
                speed_mbps: 100_000,
                mtu: 9000,
                numa: 0,
                rdma_dev: "mlx5_0".into(),
            }],
            regions: vec![RegionMeta {
                id: 1,
                base: 0x7f00_0000_0000,
                len: 1 << 30,
                dev: 0,
                mem: MemType::Dram,
                access: Access::ReadOnly,
                key: RegionKey([7; 16]),
            }],
        }
    }

    #[test]
    fn metadata_round_trips_and_rejects_every_truncation() {
        let m = sample();
        let b = m.encode();
        assert_eq!(AgentMeta::decode(&b).unwrap(), m);
        for cut in 0..b.len() {
            assert!(AgentMeta::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn forged_region_count_does_not_allocate() {
        let mut m = sample();
        m.regions.clear();
        let mut b = m.encode();
        let n = b.len();
        b[n - 4..].copy_from_slice(&(MAX_REGIONS as u32).to_le_bytes());
        assert!(matches!(AgentMeta::decode(&b), Err(DecodeError::Truncated { .. })));
        b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(AgentMeta::decode(&b), Err(DecodeError::TooMany { .. })));
    }

    #[test]
    fn metadata_version_mismatch_is_named() {
        let mut b = sample().encode();
        b[4] = 9;
        assert!(matches!(AgentMeta::decode(&b), Err(DecodeError::VersionMismatch { got: 9, .. })));
    }

    #[test]
    fn desc_list_round_trips_and_bounds() {
        let d = DescList { mem: MemType::Dram, descs: vec![(4096, 100, 0), (1 << 40, 1 << 20, 3)] };
        let b = d.encode();
        assert_eq!(DescList::decode(&b).unwrap(), d);
        for cut in 0..b.len() {
            assert!(DescList::decode(&b[..cut]).is_err());
        }
        let wrap = DescList { mem: MemType::Dram, descs: vec![(u64::MAX, 2, 0)] };
        assert!(DescList::decode(&wrap.encode()).is_err());
    }

    #[test]
    fn key_compare_is_exact() {
        assert!(RegionKey([1; 16]).ct_eq(&RegionKey([1; 16])));
        let mut k = [1u8; 16];
        k[15] = 2;
        assert!(!RegionKey([1; 16]).ct_eq(&RegionKey(k)));
    }
}
