//! GPUDirect RDMA per device (issue 35, item 7): what a VRAM region's GPU must allow before
//! UCX maps it for direct RMA, and the flush that makes NIC writes into VRAM visible where the
//! device does not order them itself (docs/gpu.md, "GPUDirect RDMA").
//!
//! Where the target learns that a peer's UCX WRITE landed: the peer completes its writes
//! (`ucp_worker_flush`: remotely complete) and then sends a notification over its control
//! connection; the application reads the VRAM after taking that notification. So a device
//! whose `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` is neither OWNER nor ALL_DEVICES
//! gets `cuFlushGPUDirectRDMAWrites(TARGET_CURRENT_CTX, TO_OWNER)` before each notification is
//! queued ([`GdrFlush::flush`], called by the server). A READ's gets write the initiator's own
//! VRAM: such a device is flushed after each READ chunk into it, before the chunk counts as done
//! ([`GdrFlush::flush_device`], called by the ucx rails).

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use multirail_gpu::{Device, Gpu, GpuKind};

/// The devices with VRAM mapped for direct RMA whose RDMA writes need a flush.
#[derive(Default)]
pub(crate) struct GdrFlush {
    devices: Mutex<BTreeMap<(GpuKind, i32), Gpu>>,
}

impl GdrFlush {
    /// A VRAM region of `gpu` is about to be mapped for direct RMA, with the kernel's GPUDirect
    /// support `kernel` ("peermem (...)" or "dma-buf (...)", `UcxAgent::gpu_direct_way`).
    /// Refuses a dma-buf-only host whose driver says the device cannot export dma-buf
    /// (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` = 0); remembers the device when its writes need
    /// flushing. Returns whether they do.
    pub fn note_region(&self, gpu: &Gpu, kernel: &str) -> Result<bool, String> {
        if kernel.starts_with("dma-buf") && gpu.dma_buf_supported().map_err(|e| e.to_string())? == Some(false) {
            return Err(format!(
                "GPU {} cannot export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0) and no peermem is loaded: its \
                 memory cannot be registered with the NIC",
                gpu.id()
            ));
        }
        let ordering = gpu.rdma_writes_ordering().map_err(|e| format!("GPU {}: {e}", gpu.id()))?;
        if !ordering.needs_flush() {
            return Ok(false);
        }
        self.devices.lock().unwrap_or_else(PoisonError::into_inner).entry((gpu.kind(), gpu.id())).or_insert_with(|| gpu.clone());
        Ok(true)
    }

    /// A READ by GPUDirect landed in local memory of device `id`: flush that device's RDMA writes
    /// if it needs it, before the chunk counts as done (the application reads the pages once the
    /// transfer completed). Returns whether it flushed.
    pub fn flush_device(&self, id: i32) -> Result<bool, String> {
        let devices: Vec<Gpu> =
            self.devices.lock().unwrap_or_else(PoisonError::into_inner).iter().filter(|(k, _)| k.1 == id).map(|(_, g)| g.clone()).collect();
        for g in &devices {
            g.flush_rdma_writes().map_err(|e| format!("cuFlushGPUDirectRDMAWrites on GPU {}: {e}", g.id()))?;
        }
        Ok(!devices.is_empty())
    }

    /// Before the target reports that writes landed (a notification is queued): flush the RDMA
    /// writes of every device that needs it. Returns how many were flushed, or the first error.
    pub fn flush(&self) -> Result<usize, String> {
        let devices: Vec<Gpu> = self.devices.lock().unwrap_or_else(PoisonError::into_inner).values().cloned().collect();
        for g in &devices {
            g.flush_rdma_writes().map_err(|e| format!("cuFlushGPUDirectRDMAWrites on GPU {}: {e}", g.id()))?;
        }
        Ok(devices.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multirail_gpu::RdmaWritesOrdering;

    /// Issue 35, item 7d: a stand-in GPU whose write ordering is NONE is flushed once per
    /// notification; one ordered for its owner (or all devices) never is.
    #[test]
    fn unordered_devices_are_flushed_before_a_notification() {
        let unordered = Gpu::open(GpuKind::StandIn, 41).unwrap();
        let owner = Gpu::open(GpuKind::StandIn, 42).unwrap();
        let all = Gpu::open(GpuKind::StandIn, 43).unwrap();
        unordered.as_standin().unwrap().set_gdr(None, RdmaWritesOrdering::None);
        owner.as_standin().unwrap().set_gdr(None, RdmaWritesOrdering::Owner);
        all.as_standin().unwrap().set_gdr(None, RdmaWritesOrdering::AllDevices);
        let f = GdrFlush::default();
        assert_eq!(f.note_region(&owner, "peermem (nvidia_peermem loaded)"), Ok(false));
        assert_eq!(f.note_region(&all, "peermem (nvidia_peermem loaded)"), Ok(false));
        assert_eq!(f.flush(), Ok(0));
        assert_eq!(f.note_region(&unordered, "peermem (nvidia_peermem loaded)"), Ok(true));
        assert_eq!(f.note_region(&unordered, "peermem (nvidia_peermem loaded)"), Ok(true), "a second region, same device");
        assert_eq!(f.flush(), Ok(1));
        assert_eq!(f.flush(), Ok(1));
        assert_eq!(unordered.as_standin().unwrap().rdma_flushes(), 2);
        // After a READ into one device (item 7e): that device only, and only if it needs it.
        assert_eq!(f.flush_device(41), Ok(true));
        assert_eq!(f.flush_device(42), Ok(false));
        assert_eq!(unordered.as_standin().unwrap().rdma_flushes(), 3);
        assert_eq!(owner.as_standin().unwrap().rdma_flushes() + all.as_standin().unwrap().rdma_flushes(), 0);
        assert_eq!(RdmaWritesOrdering::from_attr(0), RdmaWritesOrdering::None);
        assert_eq!(RdmaWritesOrdering::from_attr(100), RdmaWritesOrdering::Owner);
        assert_eq!(RdmaWritesOrdering::from_attr(200), RdmaWritesOrdering::AllDevices);
    }

    /// Issue 35, item 7b: where only dma-buf gives GPUDirect, a device whose driver says it
    /// cannot export dma-buf is refused with the reason; with peermem it is not asked.
    #[test]
    fn dma_buf_only_hosts_need_a_device_that_exports_it() {
        let no_dmabuf = Gpu::open(GpuKind::StandIn, 44).unwrap();
        let dmabuf = Gpu::open(GpuKind::StandIn, 45).unwrap();
        no_dmabuf.as_standin().unwrap().set_gdr(Some(false), RdmaWritesOrdering::Owner);
        dmabuf.as_standin().unwrap().set_gdr(Some(true), RdmaWritesOrdering::Owner);
        let f = GdrFlush::default();
        let kernel = "dma-buf (the open NVIDIA kernel module on Linux 6.8.0)";
        let e = f.note_region(&no_dmabuf, kernel).unwrap_err();
        assert!(e.contains("DMA_BUF_SUPPORTED = 0") && e.contains("GPU 44"), "{e}");
        assert_eq!(f.note_region(&dmabuf, kernel), Ok(false));
        assert_eq!(f.note_region(&no_dmabuf, "peermem (nvidia_peermem loaded)"), Ok(false));
    }
}
