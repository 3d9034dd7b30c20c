//! The memory registry: regions this agent registered, their keys and access rights.
//!
//! Remote requests name a region id, a key, an offset and a length; [`Registry::check_remote`]
//! validates all four (and the access right) before any pointer is formed, so a peer touches
//! only memory exported to it. Addresses from the wire are never trusted.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use multirail_proto::codec::{RemoteOp, VecOp};
use multirail_proto::{Access, MemType, RegionKey, RegionMeta, Status};

use crate::error::{Error, Result};

/// A registered region: its published description, and nothing else to keep in step with it.
/// The memory belongs to the caller (Python keeps the object alive while it is registered);
/// holders of an `Arc<Region>` block its deregistration.
#[derive(Debug)]
pub struct Region(RegionMeta, std::sync::atomic::AtomicBool);

impl std::ops::Deref for Region {
    type Target = RegionMeta;
    fn deref(&self) -> &RegionMeta {
        &self.0
    }
}

impl Region {
    pub fn meta(&self) -> RegionMeta {
        self.0.clone()
    }

    /// Whether the region was withdrawn ([`Registry::withdraw`]) while something held it: a
    /// handle holding it must not be posted again.
    pub fn withdrawn(&self) -> bool {
        self.1.load(Ordering::Acquire)
    }

    /// Raw pointer to `offset` (bounds already checked by the caller).
    pub fn ptr(&self, offset: u64) -> *mut u8 {
        (self.base + offset) as *mut u8
    }
}

pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).expect("the OS random source is available");
    b
}

#[derive(Debug, Default)]
pub struct Registry {
    by_id: RwLock<BTreeMap<u64, Arc<Region>>>,
    next_id: AtomicU64,
}

impl Registry {
    pub fn register(&self, base: u64, len: u64, dev: u32, mem: MemType, access: Access) -> Result<Arc<Region>> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot register an empty region".into()));
        }
        if base == 0 || base.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!("bad region address {base:#x} + {len}")));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let r = Arc::new(Region(RegionMeta { id, base, len, dev, mem, access, key: RegionKey(random_bytes()) }, Default::default()));
        // Overlapping registrations are allowed (NIXL allows them); lookups pick a region that
        // contains the whole descriptor.
        self.by_id.write().expect("registry lock").insert(id, r.clone());
        Ok(r)
    }

    /// Remove a region. Fails while a transfer handle or an in-flight request holds it.
    pub fn deregister(&self, id: u64, wait: std::time::Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            {
                let mut by_id = self.by_id.write().expect("registry lock");
                let Some(r) = by_id.get(&id) else {
                    return Err(Error::InvalidArgument(format!("region {id} is not registered")));
                };
                // The map's own reference is the only one when nobody else holds it.
                if Arc::strong_count(r) == 1 {
                    by_id.remove(&id);
                    return Ok(());
                }
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::InvalidArgument(format!(
                    "region {id} is in use by a transfer handle or an in-flight request; release the handles first"
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Remove a region at once, whoever holds it: peers are refused from now on, and a transfer
    /// handle that holds it fails its next post ([`Region::withdrawn`]). A request already being
    /// served finishes (the caller must not free memory with transfers in flight on it).
    pub fn withdraw(&self, id: u64) -> Result<()> {
        let r = self.by_id.write().expect("registry lock").remove(&id);
        let r = r.ok_or_else(|| Error::InvalidArgument(format!("region {id} is not registered")))?;
        r.1.store(true, Ordering::Release);
        Ok(())
    }

    /// The registered region that contains [addr, addr+len), if any.
    pub fn find_local(&self, addr: u64, len: u64) -> Option<Arc<Region>> {
        let end = addr.checked_add(len)?;
        let by_id = self.by_id.read().expect("registry lock");
        // A scan: agents register few regions. Bulk resolution uses `snapshot` + binary search.
        by_id.values().find(|r| r.base <= addr && end <= r.base + r.len).cloned()
    }

    /// Regions sorted by base, for vectorised resolution of many descriptors.
    pub fn snapshot(&self) -> Vec<Arc<Region>> {
        let mut v: Vec<Arc<Region>> = self.by_id.read().expect("registry lock").values().cloned().collect();
        v.sort_by_key(|r| (r.base, std::cmp::Reverse(r.len)));
        v
    }

    /// Regions a peer may see: everything registered for remote access.
    pub fn exported(&self) -> Vec<RegionMeta> {
        self.by_id.read().expect("registry lock").values().filter(|r| r.access != Access::Local).map(|r| r.meta()).collect()
    }

    /// Validate a remote request; on success the caller may touch `len` bytes at
    /// `region.ptr(offset)` while it holds the returned `Arc`.
    pub fn check_remote(&self, op: &RemoteOp, write: bool) -> std::result::Result<Arc<Region>, (Status, String)> {
        let by_id = self.by_id.read().expect("registry lock");
        let Some(r) = by_id.get(&op.region) else {
            return Err((Status::UnknownRegion, format!("no exported region {}", op.region)));
        };
        if r.access == Access::Local {
            return Err((Status::UnknownRegion, format!("no exported region {}", op.region)));
        }
        if !r.key.ct_eq(&op.key) {
            return Err((Status::BadKey, format!("wrong key for region {}", op.region)));
        }
        match op.offset.checked_add(op.len) {
            Some(end) if end <= r.len => {}
            _ => return Err((Status::OutOfBounds, format!("offset {} + {} outside region of {} bytes", op.offset, op.len, r.len))),
        }
        if write && r.access != Access::ReadWrite {
            return Err((Status::ReadOnly, format!("region {} is read-only", op.region)));
        }
        Ok(r.clone())
    }

    /// Validate a vectored request: the region, its key and access as `check_remote`, and
    /// every piece inside the region (its last byte, with overflow checked), all before the
    /// caller forms any pointer. A GPU region's pieces are staged by the caller (the region
    /// says which memory it is).
    pub fn check_vec(&self, op: &VecOp, write: bool) -> std::result::Result<Arc<Region>, (Status, String)> {
        let first = RemoteOp { region: op.region, key: op.key, offset: 0, len: 0 };
        let r = self.check_remote(&first, write)?;
        for (i, p) in op.pieces.iter().enumerate() {
            match p.end() {
                Some(end) if p.len > 0 && p.count > 0 && end <= r.len => {}
                _ => {
                    return Err((
                        Status::OutOfBounds,
                        format!(
                            "piece {i} ({} x {} bytes at offset {} stride {}) outside region of {} bytes",
                            p.count, p.len, p.offset, p.stride, r.len
                        ),
                    ))
                }
            }
        }
        Ok(r)
    }
}

/// Two byte ranges `(offset, len)` of a vectored request (its pieces expanded: `count` ranges
/// each) that share a byte, the first such pair in offset order; None when they are disjoint.
/// O(n log n) in the ranges, which the decoder bounds (`MAX_VEC_PIECES`). A WRITE of them into
/// GPU memory is refused: its copies run in one launch, in no order (`server::Conn::write_vec`).
pub fn overlapping_ranges(op: &VecOp) -> Option<((u64, u64), (u64, u64))> {
    let mut spans: Vec<(u64, u64)> =
        op.pieces.iter().flat_map(|p| (0..p.count).map(move |k| (p.offset.saturating_add(k.saturating_mul(p.stride)), p.len))).collect();
    spans.sort_unstable();
    // Sorted by offset and disjoint so far, a range can overlap only the one just before it.
    spans.windows(2).find(|w| w[1].0 < w[0].0.saturating_add(w[0].1)).map(|w| (w[0], w[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_checks_each_field() {
        let reg = Registry::default();
        let buf = vec![0u8; 4096];
        let r = reg.register(buf.as_ptr() as u64, 4096, 0, MemType::Dram, Access::ReadOnly).unwrap();
        let ok = RemoteOp { region: r.id, key: r.key, offset: 4000, len: 96 };
        assert!(reg.check_remote(&ok, false).is_ok());
        assert_eq!(reg.check_remote(&ok, true).unwrap_err().0, Status::ReadOnly);
        assert_eq!(reg.check_remote(&RemoteOp { len: 97, ..ok }, false).unwrap_err().0, Status::OutOfBounds);
        assert_eq!(reg.check_remote(&RemoteOp { offset: u64::MAX, ..ok }, false).unwrap_err().0, Status::OutOfBounds);
        assert_eq!(reg.check_remote(&RemoteOp { key: RegionKey([0; 16]), ..ok }, false).unwrap_err().0, Status::BadKey);
        assert_eq!(reg.check_remote(&RemoteOp { region: 99, ..ok }, false).unwrap_err().0, Status::UnknownRegion);
        let local = reg.register(buf.as_ptr() as u64, 16, 0, MemType::Dram, Access::Local).unwrap();
        let op = RemoteOp { region: local.id, key: local.key, offset: 0, len: 1 };
        assert_eq!(reg.check_remote(&op, false).unwrap_err().0, Status::UnknownRegion, "local regions are not exported");
        assert_eq!(reg.exported().len(), 1);
    }

    #[test]
    fn vectored_requests_check_every_piece() {
        use multirail_proto::codec::VecPiece;
        let reg = Registry::default();
        let buf = vec![0u8; 1 << 16];
        let r = reg.register(buf.as_ptr() as u64, 1 << 16, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let p = |offset, len, count, stride| VecPiece { offset, len, count, stride };
        let op = |pieces| VecOp { region: r.id, key: r.key, pieces };
        assert!(reg.check_vec(&op(vec![p(0, 4096, 1, 0), p(4096, 4096, 15, 4096)]), true).is_ok());
        // The last piece of a strided entry ends exactly at the region's end, then one past it.
        assert!(reg.check_vec(&op(vec![p(0, 8, 1, 0), p(4096, 4096, 8, 8192)]), false).is_ok());
        for past in [p(4097, 4096, 8, 8192), p(4096, 4096, 8, 8193), p(4096, 4097, 8, 8192)] {
            assert_eq!(reg.check_vec(&op(vec![p(0, 8, 1, 0), past]), false).unwrap_err().0, Status::OutOfBounds);
        }
        assert_eq!(reg.check_vec(&op(vec![p(u64::MAX, 2, 1, 0)]), false).unwrap_err().0, Status::OutOfBounds);
        assert_eq!(reg.check_vec(&op(vec![p(0, 1, u64::MAX, u64::MAX)]), false).unwrap_err().0, Status::OutOfBounds);
        let bad = VecOp { key: RegionKey([0; 16]), ..op(vec![p(0, 1, 1, 0)]) };
        assert_eq!(reg.check_vec(&bad, false).unwrap_err().0, Status::BadKey);
        let ro = reg.register(buf.as_ptr() as u64, 16, 0, MemType::Dram, Access::ReadOnly).unwrap();
        let w = VecOp { region: ro.id, key: ro.key, pieces: vec![p(0, 1, 1, 0)] };
        assert_eq!(reg.check_vec(&w, true).unwrap_err().0, Status::ReadOnly);
        // A GPU region passes the same checks and stays marked GPU (its server stages it).
        let gpu = reg.register(1 << 40, 4096, 0, MemType::Vram, Access::ReadWrite).unwrap();
        let g = |pieces| VecOp { region: gpu.id, key: gpu.key, pieces };
        assert_eq!(reg.check_vec(&g(vec![p(0, 1, 1, 0), p(8, 8, 511, 8)]), true).unwrap().mem, MemType::Vram);
        assert_eq!(reg.check_vec(&g(vec![p(8, 8, 512, 8)]), false).unwrap_err().0, Status::OutOfBounds);
    }

    #[test]
    fn overlapping_ranges_of_a_vectored_request_are_found() {
        use multirail_proto::codec::VecPiece;
        let p = |offset, len, count, stride| VecPiece { offset, len, count, stride };
        let op = |pieces| VecOp { region: 1, key: RegionKey([0; 16]), pieces };
        assert_eq!(overlapping_ranges(&op(vec![p(4096, 4096, 1, 0), p(0, 4096, 1, 0), p(8192, 8, 4, 8)])), None);
        // Out of order, and one entry inside a strided one's range.
        assert_eq!(overlapping_ranges(&op(vec![p(100, 8, 1, 0), p(0, 16, 1, 0), p(8, 8, 1, 0)])), Some(((0, 16), (8, 8))));
        assert_eq!(overlapping_ranges(&op(vec![p(0, 4, 4, 16), p(35, 2, 1, 0)])), Some(((32, 4), (35, 2))));
        // The same range twice; a range ending where the next begins is no overlap.
        assert_eq!(overlapping_ranges(&op(vec![p(64, 8, 1, 0), p(64, 8, 1, 0)])), Some(((64, 8), (64, 8))));
        assert_eq!(overlapping_ranges(&op(vec![p(0, 8, 1, 0), p(8, 8, 1, 0)])), None);
    }

    #[test]
    fn gpu_regions_pass_the_same_checks_and_stay_marked_gpu() {
        // The server stages a GPU region through the device (never a host dereference): the
        // region it gets back must say so, after the same key and bounds checks as host memory.
        let reg = Registry::default();
        let r = reg.register(1 << 40, 4096, 3, MemType::Vram, Access::ReadWrite).unwrap();
        let op = RemoteOp { region: r.id, key: r.key, offset: 0, len: 16 };
        let got = reg.check_remote(&op, true).unwrap();
        assert_eq!((got.mem, got.dev), (MemType::Vram, 3));
        let oob = RemoteOp { offset: 4090, ..op };
        assert_eq!(reg.check_remote(&oob, false).unwrap_err().0, Status::OutOfBounds);
        let bad = RemoteOp { key: RegionKey([0; 16]), ..op };
        assert_eq!(reg.check_remote(&bad, false).unwrap_err().0, Status::BadKey);
    }

    #[test]
    fn deregister_waits_for_holders() {
        let reg = Registry::default();
        let buf = [0u8; 64];
        let r = reg.register(buf.as_ptr() as u64, 64, 0, MemType::Dram, Access::ReadWrite).unwrap();
        let id = r.id;
        drop(r);
        let held = reg.find_local(buf.as_ptr() as u64, 8).unwrap();
        let e = reg.deregister(id, std::time::Duration::from_millis(20));
        assert!(e.is_err());
        drop(held);
        reg.deregister(id, std::time::Duration::ZERO).unwrap();
        assert!(reg.find_local(buf.as_ptr() as u64, 8).is_none());
    }
}
