//! Where memory and threads are: the NUMA node of a page, the calling thread's node, pinning a
//! thread to a NIC's local CPUs and placing a buffer on a node (issue 34, docs/topology.md,
//! "The engine"). Everything here is best effort: a call that the kernel refuses (no NUMA
//! support, a container's CPU set, seccomp) reports `None`/`false` and changes nothing.

/// Where a transfer's local memory is, for rail choice (`AgentConfig.affinity`): GPU `k` (the
/// CUDA ordinal as this process sees it) or host memory on NUMA node `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Loc {
    Gpu(u32),
    Numa(i32),
}

impl Loc {
    /// "gpu:K" or "numa:N".
    pub fn parse(s: &str) -> Option<Loc> {
        let (kind, n) = s.trim().split_once(':')?;
        match kind.trim() {
            "gpu" => n.trim().parse().ok().map(Loc::Gpu),
            "numa" => n.trim().parse().ok().filter(|n: &i32| *n >= 0).map(Loc::Numa),
            _ => None,
        }
    }

    /// As `parse` reads it.
    pub fn label(&self) -> String {
        match self {
            Loc::Gpu(k) => format!("gpu:{k}"),
            Loc::Numa(n) => format!("numa:{n}"),
        }
    }

    /// Packed into a u64 (0 is none), for an atomic.
    pub fn pack(self) -> u64 {
        match self {
            Loc::Gpu(k) => (1 << 32) | k as u64,
            Loc::Numa(n) => (2 << 32) | n as u32 as u64,
        }
    }

    pub fn unpack(v: u64) -> Option<Loc> {
        match v >> 32 {
            1 => Some(Loc::Gpu(v as u32)),
            2 => Some(Loc::Numa(v as u32 as i32)),
            _ => None,
        }
    }
}

/// The node the page holding `addr` is on; None when the page is not resident (never touched,
/// swapped out) or the kernel cannot say (no NUMA support). One `move_pages` query, no move.
pub fn node_of_addr(addr: u64) -> Option<i32> {
    if addr == 0 {
        return None;
    }
    let page = addr & !(page_size() - 1);
    let mut pages = [page as *mut libc::c_void];
    let mut status = [-1i32];
    // SAFETY: a query (nodes = NULL) for one page of this process: the kernel only writes
    // `status`, which holds one entry; `page` need not be mapped (status is then negative).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_long,
            1 as libc::c_ulong,
            pages.as_mut_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    (rc == 0 && status[0] >= 0).then_some(status[0])
}

/// The NUMA node of the CPU the calling thread runs on now.
pub fn current_node() -> Option<i32> {
    let (mut cpu, mut node) = (0u32, 0u32);
    // SAFETY: getcpu writes two u32s we own; the third (cache) argument is unused since 2.6.24.
    let rc = unsafe { libc::syscall(libc::SYS_getcpu, &mut cpu as *mut u32, &mut node as *mut u32, std::ptr::null_mut::<libc::c_void>()) };
    (rc == 0).then_some(node as i32)
}

/// Host memory at `addr`'s node: the node of its page when resident, else the calling thread's.
pub fn host_node(addr: u64) -> Option<i32> {
    node_of_addr(addr).or_else(current_node)
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// A kernel CPU list ("0-3,8,10-11", sysfs `local_cpulist`) as CPU numbers; None when it does
/// not parse.
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?),
            None => {
                let a = part.parse::<usize>().ok()?;
                (a, a)
            }
        };
        if b < a || b >= libc::CPU_SETSIZE as usize {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

/// The CPUs the calling thread may run on now.
pub fn current_affinity() -> Option<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    // SAFETY: CPU_ISSET reads the set we own, for indices below CPU_SETSIZE.
    Some((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// Pin the calling thread to `cpus` (a rail's NIC-local CPUs), kept to those it may use now.
/// Does nothing (returns false) when the list is empty, would not narrow what the thread may
/// use already (the list is every CPU), or leaves no CPU the thread may use; a refusal by the
/// kernel is ignored too: a thread off its NIC's node is slower, not wrong.
pub fn pin_current_thread(cpus: &[usize]) -> bool {
    if cpus.is_empty() {
        return false;
    }
    let Some(allowed) = current_affinity() else { return false };
    let want: Vec<usize> = cpus.iter().copied().filter(|c| allowed.contains(c)).collect();
    if want.is_empty() || want.len() == allowed.len() {
        return false;
    }
    // SAFETY: as in current_affinity; CPU_SET writes indices below CPU_SETSIZE (parse_cpulist
    // and `allowed` bound them).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in &want {
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    rc == 0
}

/// Ask that the pages of `[ptr, ptr + len)` not yet touched come from `node` (MPOL_PREFERRED:
/// another node when it is full; pages already there stay). For buffers allocated before their
/// first touch. Returns whether the kernel took the policy.
pub fn prefer_node(ptr: *mut u8, len: usize, node: i32) -> bool {
    let Some(mask) = node_mask(node) else { return false };
    if ptr.is_null() || len == 0 {
        return false;
    }
    let ps = page_size() as usize;
    let start = (ptr as usize) & !(ps - 1);
    let end = (ptr as usize + len).next_multiple_of(ps);
    // SAFETY: mbind only changes the policy of this process's range; maxnode covers `mask`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            start as *mut libc::c_void,
            (end - start) as libc::c_ulong,
            MPOL_PREFERRED,
            mask.as_ptr(),
            (mask.len() * 64) as libc::c_ulong,
            0 as libc::c_uint,
        )
    };
    rc == 0
}

/// The NUMA node of the CPUs in `cpus` (a rail's NIC-local CPUs): the node of the first one
/// that sysfs places (`/sys/devices/system/cpu/cpuN/nodeM`); None when the list is empty or
/// sysfs does not say (no NUMA support).
pub fn node_of_cpus(cpus: &[usize]) -> Option<i32> {
    cpus.iter().find_map(|c| {
        std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{c}"))
            .ok()?
            .flatten()
            .find_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse::<i32>().ok().filter(|n| *n >= 0))
    })
}

const MPOL_PREFERRED: libc::c_int = 1;
/// Enough bits for 1024 nodes (the kernel's default MAX_NUMNODES is at most that).
type NodeMask = [u64; 16];

fn node_mask(node: i32) -> Option<NodeMask> {
    if node < 0 || node as usize >= 1024 {
        return None;
    }
    let mut mask = [0u64; 16];
    mask[node as usize / 64] |= 1u64 << (node as usize % 64);
    Some(mask)
}

/// Runs `f` (an allocation that touches its pages, such as `cudaHostAlloc`, which pins them at
/// once) with the calling thread's memory policy set to prefer `node`, then puts the thread's
/// previous policy back. With `None`, or when the kernel refuses the policy, `f` runs as is:
/// placement is best effort.
pub fn with_preferred_node<T>(node: Option<i32>, f: impl FnOnce() -> T) -> T {
    let Some(mask) = node.and_then(node_mask) else { return f() };
    let mut old_mode: libc::c_int = 0;
    let mut old_mask: NodeMask = [0; 16];
    let bits = (old_mask.len() * 64) as libc::c_ulong;
    // SAFETY: get_mempolicy writes one int and at most `bits` bits into buffers we own.
    let got = unsafe {
        libc::syscall(libc::SYS_get_mempolicy, &mut old_mode as *mut libc::c_int, old_mask.as_mut_ptr(), bits, 0usize, 0 as libc::c_ulong)
    } == 0;
    // SAFETY: set_mempolicy reads `bits` bits of the mask we own; it only affects this thread.
    let set = got && unsafe { libc::syscall(libc::SYS_set_mempolicy, MPOL_PREFERRED, mask.as_ptr(), bits) } == 0;
    let out = f();
    if set {
        // MPOL_DEFAULT (0) takes an empty mask; any other mode its own.
        let m = if old_mode == 0 { std::ptr::null() } else { old_mask.as_ptr() };
        // SAFETY: as above, with the policy read before.
        unsafe { libc::syscall(libc::SYS_set_mempolicy, old_mode, m, if old_mode == 0 { 0 } else { bits }) };
    }
    out
}

/// The memory policy of the page at `addr` (MPOL_F_ADDR): (mode, nodes); None when the kernel
/// cannot say. Mode 0 is the default policy, 1 MPOL_PREFERRED, 2 MPOL_BIND.
pub fn policy_of_addr(addr: u64) -> Option<(i32, Vec<i32>)> {
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut mode: libc::c_int = 0;
    let mut mask: NodeMask = [0; 16];
    // SAFETY: a query for this process's address; writes one int and the mask we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            (mask.len() * 64) as libc::c_ulong,
            addr as usize,
            MPOL_F_ADDR,
        )
    };
    let nodes = (0..1024).filter(|&n| mask[n / 64] & (1u64 << (n % 64)) != 0).map(|n| n as i32).collect();
    (rc == 0).then_some((mode, nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_and_pack() {
        for l in [Loc::Gpu(0), Loc::Gpu(7), Loc::Numa(0), Loc::Numa(3)] {
            assert_eq!(Loc::parse(&l.label()), Some(l));
            assert_eq!(Loc::unpack(l.pack()), Some(l));
        }
        assert_eq!(Loc::unpack(0), None);
        for bad in ["gpu", "gpu:x", "numa:-1", "cpu:0", ""] {
            assert_eq!(Loc::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn cpulists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn a_touched_page_has_a_node_and_an_untouched_one_falls_back() {
        let v = vec![1u8; 1 << 16];
        assert!(node_of_addr(v.as_ptr() as u64).is_some_and(|n| n >= 0));
        assert_eq!(node_of_addr(0), None);
        assert!(host_node(v.as_ptr() as u64).is_some());
    }

    #[test]
    fn pinning_narrows_the_thread_and_skips_what_would_not() {
        let t = std::thread::spawn(|| {
            let all = current_affinity().expect("affinity");
            assert!(!pin_current_thread(&[]), "unknown: skipped");
            assert!(!pin_current_thread(&all), "every CPU: skipped");
            if all.len() < 2 {
                return;
            }
            assert!(pin_current_thread(&all[..1]));
            assert_eq!(current_affinity().expect("affinity"), all[..1].to_vec());
        });
        t.join().expect("thread");
    }
}
