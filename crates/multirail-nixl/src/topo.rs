//! The GPU/NIC topology from sysfs and the NICs each memory location should use: the default
//! case of python/multirail/topology.py (`Topology.load(root, gpus).rail_plan()`, no hints, no
//! `include`, `share="split"`), ported so the NIXL plugin can tier its rails per memory
//! location (issue 34; docs/topology.md). The rules are topology.py's, in the same order; the
//! equivalence on every fixture tree of tests/topo_fixtures.py is tested by
//! tests/test_nixl_topology.py (through [`crate::mr_nixl_topology_json`]).
//!
//! Facts: PCI functions under `ROOT/bus/pci/devices` (their realpath below `ROOT/devices` from
//! the `pciDDDD:BB` root-bus component down), GPUs (NVIDIA, class 0x0302xx/0x0300xx), NICs
//! (RDMA devices under `ROOT/class/infiniband` and PCI netdevs under `ROOT/class/net`, merged
//! per function), NUMA nodes with CPUs, and the CUDA view (ordinal, UUID, PCI bus id) from a
//! `--gpus`-style file, else `nvidia-smi` on the live `/sys`, else PCI order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// nvidia-smi's distance classes, nearest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Pix,
    Pxb,
    Phb,
    Node,
    Sys,
    /// Named for a GPU by the hint file (only ever a GPU's first tier).
    Hint,
}

impl Class {
    const ALL: [Class; 5] = [Class::Pix, Class::Pxb, Class::Phb, Class::Node, Class::Sys];

    pub fn name(self) -> &'static str {
        match self {
            Class::Pix => "PIX",
            Class::Pxb => "PXB",
            Class::Phb => "PHB",
            Class::Node => "NODE",
            Class::Sys => "SYS",
            Class::Hint => "HINT",
        }
    }

    fn why(self) -> &'static str {
        match self {
            Class::Pix => "at most one PCIe bridge between them (same switch)",
            Class::Pxb => "several PCIe bridges, no host bridge (nested switches)",
            Class::Phb => "through the PCIe host bridge (same root bus)",
            Class::Node => "across host bridges within one NUMA node",
            Class::Sys => "across the socket link (other NUMA node)",
            Class::Hint => "named for this GPU by the hint file",
        }
    }
}

const NVIDIA: u32 = 0x10de;
const MELLANOX: u32 = 0x15b3;
const DPU_DEVICE_IDS: [u32; 4] = [0xa2d2, 0xa2d6, 0xa2dc, 0xa2df];
const DPU_HCA_TYPES: [&str; 3] = ["MT41682", "MT41686", "MT41692"];

// ---------------------------------------------------------------------------------------------
// Small parsers (topology.py's, same results)

fn is_hex(s: &str, lo: usize, hi: usize) -> bool {
    (lo..=hi).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `DDDD:BB:DD.F` with 4 to 8 domain digits (topology.py's `_BDF_RE`).
fn is_bdf(s: &str) -> bool {
    let mut it = s.splitn(3, ':');
    let (Some(d), Some(b), Some(rest)) = (it.next(), it.next(), it.next()) else { return false };
    let Some((dev, f)) = rest.split_once('.') else { return false };
    is_hex(d, 4, 8) && is_hex(b, 2, 2) && is_hex(dev, 2, 2) && f.len() == 1 && ('0'..='7').contains(&f.chars().next().unwrap_or('x'))
}

/// `pciDDDD:BB`: a root bus component.
fn is_root_comp(s: &str) -> bool {
    s.strip_prefix("pci").and_then(|r| r.split_once(':')).is_some_and(|(d, b)| is_hex(d, 4, 8) && is_hex(b, 2, 2))
}

/// `00000000:1B:00.0` / `0000:1b:00.0` / `1b:00.0` -> `0000:1b:00.0`; None when not a bus id.
pub fn normalize_bus_id(text: &str) -> Option<String> {
    let mut t = text.trim().to_ascii_lowercase();
    if t.matches(':').count() == 1 {
        t = format!("0000:{t}");
    }
    if !is_bdf(&t) {
        return None;
    }
    let (dom, rest) = t.split_once(':')?;
    let dom = dom.trim_start_matches('0');
    Some(format!("{dom:0>4}:{rest}"))
}

/// Sort key of a bus id: (domain, bus, device, function).
fn bdf_key(bdf: &str) -> (u64, u64, u64, u64) {
    let mut parts = bdf.split([':', '.']).map(|p| u64::from_str_radix(p, 16).unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next(), next())
}

/// CPU numbers at or above this are no kernel's (x86's largest NR_CPUS is 8192): a list naming
/// one is malformed.
pub const MAX_CPUS: usize = 1 << 16;

/// `0-55,112-167` -> the CPUs, sorted; empty when empty or malformed (a CPU of [`MAX_CPUS`] or
/// above included).
pub fn parse_cpulist(text: &str) -> Vec<usize> {
    let mut out = BTreeSet::new();
    for part in text.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let range = match part.split_once('-') {
            Some((lo, hi)) => lo.trim().parse::<usize>().ok().zip(hi.trim().parse::<usize>().ok()),
            None => part.parse::<usize>().ok().map(|c| (c, c)),
        };
        let Some((lo, hi)) = range.filter(|&(_, hi)| hi < MAX_CPUS) else { return Vec::new() };
        out.extend(lo..=hi);
    }
    out.into_iter().collect()
}

/// The leading number of `text` when `unit` follows it (`32.0 GT/s PCIe`, `400 Gb/sec (4X NDR)`).
fn number_before(text: &str, unit: &str) -> Option<f64> {
    let t = text.trim_start();
    let end = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    if end == 0 || !t[end..].trim_start().starts_with(unit) {
        return None;
    }
    t[..end].parse().ok()
}

/// Python's `int(text, 0)` for what sysfs holds: decimal, or hex with `0x`.
fn parse_int(text: &str) -> Option<i64> {
    let t = text.trim();
    let (neg, t) = t.strip_prefix('-').map_or((false, t), |r| (true, r));
    let v = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => i64::from_str_radix(h, 16).ok()?,
        None => t.parse::<i64>().ok()?,
    };
    Some(if neg { -v } else { v })
}

fn hexint(text: Option<String>) -> Option<u32> {
    let t = text?;
    let t = t.trim();
    u32::from_str_radix(t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t), 16).ok()
}

/// Python's `round(x, 1)` for the values a PCIe link gives.
fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Usable Gbit/s of a PCIe link: GT/s x lanes x encoding.
fn pcie_gbps(speed: Option<f64>, width: Option<u32>) -> Option<f64> {
    let (s, w) = (speed.filter(|s| *s > 0.0)?, width.filter(|w| *w > 0)?);
    let enc = if s < 8.0 {
        0.8
    } else if s < 64.0 {
        128.0 / 130.0
    } else {
        1.0
    };
    Some(round1(s * f64::from(w) * enc))
}

/// The most bytes an attribute file may hold (sysfs attributes are at most a page; a CPU list
/// of thousands of CPUs is far below this).
const MAX_ATTR: u64 = 1 << 20;

/// A sysfs attribute, trimmed: None when it is missing, not a regular file (a FIFO's open would
/// block), or longer than [`MAX_ATTR`].
pub(crate) fn read(p: &Path) -> Option<String> {
    let meta = std::fs::metadata(p).ok()?;
    if !meta.is_file() {
        return None;
    }
    let mut b = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(std::fs::File::open(p).ok()?, MAX_ATTR + 1), &mut b).ok()?;
    (b.len() as u64 <= MAX_ATTR).then(|| String::from_utf8_lossy(&b).trim().to_string())
}

fn realpath(p: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(p).ok()
}

// ---------------------------------------------------------------------------------------------
// Facts

/// One PCI function.
#[derive(Clone, Debug)]
pub struct PciDev {
    pub bdf: String,
    /// Its realpath's components from the root bus down (VMBus/ACPI prefixes dropped).
    chain: Vec<String>,
    vendor: Option<u32>,
    device: Option<u32>,
    class: Option<u32>,
    /// -1: unknown.
    pub numa: i32,
    pub cpus: Vec<usize>,
    max_width: Option<u32>,
    max_speed: Option<f64>,
    physfn: Option<String>,
}

impl PciDev {
    fn read(dir: &Path, devices: &Path) -> Option<PciDev> {
        let real = realpath(dir)?;
        let name = real.file_name()?.to_string_lossy().to_string();
        let bdf = normalize_bus_id(&name)?;
        let path: Vec<String> = match real.strip_prefix(devices) {
            Ok(rel) => rel.components().map(|c| c.as_os_str().to_string_lossy().to_string()).collect(),
            Err(_) => vec![name],
        };
        let chain = match path.iter().position(|c| is_root_comp(c)) {
            Some(i) => path[i..].to_vec(),
            None => path[path.len().saturating_sub(1)..].to_vec(),
        };
        let rd = |f: &str| read(&real.join(f));
        let rint = |f: &str| rd(f).and_then(|t| parse_int(&t));
        let physfn = real.join("physfn");
        let physfn = if physfn.symlink_metadata().is_ok() {
            realpath(&physfn).and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string())).filter(|n| is_bdf(n))
        } else {
            None
        };
        Some(PciDev {
            bdf,
            chain,
            vendor: hexint(rd("vendor")),
            device: hexint(rd("device")),
            class: hexint(rd("class")),
            numa: rint("numa_node").filter(|n| *n >= 0).map_or(-1, |n| n as i32),
            cpus: parse_cpulist(&rd("local_cpulist").unwrap_or_default()),
            max_width: rint("max_link_width").filter(|w| *w > 0).map(|w| w as u32),
            max_speed: rd("max_link_speed").and_then(|t| number_before(&t, "GT/s")),
            physfn: physfn.and_then(|n| normalize_bus_id(&n)),
        })
    }

    fn is_gpu(&self) -> bool {
        self.vendor == Some(NVIDIA) && self.class.is_some_and(|c| matches!(c >> 8, 0x0302 | 0x0300))
    }
}

#[derive(Clone, Debug)]
pub struct Gpu {
    pub pci: PciDev,
    pub ordinal: i64,
    pub uuid: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Nic {
    pub pci: PciDev,
    pub netdev: Option<String>,
    pub rdma: Option<String>,
    hca_type: Option<String>,
    port_state: Option<String>,
    rate_gbps: Option<f64>,
}

impl Nic {
    pub fn name(&self) -> &str {
        self.netdev.as_deref().or(self.rdma.as_deref()).unwrap_or(&self.pci.bdf)
    }

    /// Port rate capped by the PCIe link (max width and speed).
    pub fn link_gbps(&self) -> Option<f64> {
        let link = pcie_gbps(self.pci.max_speed, self.pci.max_width);
        [self.rate_gbps, link].into_iter().flatten().filter(|v| *v > 0.0).reduce(f64::min)
    }

    fn is_dpu(&self) -> bool {
        (self.pci.vendor == Some(MELLANOX) && self.pci.device.is_some_and(|d| DPU_DEVICE_IDS.contains(&d)))
            || self.hca_type.as_deref().is_some_and(|h| DPU_HCA_TYPES.contains(&h))
    }
}

/// The PCI function a `class/*/X/device` link points at (a virtio NIC's parent function).
fn pci_dir_of(link: &Path) -> Option<PathBuf> {
    let real = realpath(link).filter(|p| p.is_dir())?;
    let name = real.file_name()?.to_string_lossy().to_string();
    if is_bdf(&name) {
        return Some(real);
    }
    let virtio = name.strip_prefix("virtio").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    let parent = real.parent()?;
    (virtio && parent.file_name().is_some_and(|p| is_bdf(&p.to_string_lossy()))).then(|| parent.to_path_buf())
}

fn sorted_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[derive(Default)]
struct Found {
    netdev: Option<String>,
    rdma: Option<String>,
    hca_type: Option<String>,
    port_state: Option<String>,
    rate: Option<f64>,
    speed: Option<f64>,
}

/// What a CUDA view entry says: (ordinal, UUID, PCI bus id).
pub type CudaEntry = (i64, Option<String>, String);

/// The facts.
#[derive(Clone, Debug)]
pub struct Topology {
    pub gpus: Vec<Gpu>,
    pub nics: Vec<Nic>,
    /// NUMA nodes with CPUs.
    pub nodes: BTreeMap<i32, Vec<usize>>,
    /// Where the CUDA view came from.
    pub cuda_source: String,
    /// The hint file's pairs: GPU (bus id or UUID) -> NICs (netdev, RDMA name or PCI address).
    pub hints: Vec<(String, Vec<String>)>,
}

impl Topology {
    /// Reads `root` (a sysfs tree); `gpus`: a `--gpus`-style file (JSON list of {ordinal, uuid,
    /// pci_bus_id} or nvidia-smi's CSV), else nvidia-smi on the live /sys, else PCI order;
    /// `hints`: a `--hints` file (JSON {"<gpu bus id or UUID>": ["<nic>", ...]}).
    pub fn load(root: &Path, gpus: Option<&Path>, hints: Option<&Path>) -> Result<Topology, String> {
        let bus = root.join("bus/pci/devices");
        if !bus.is_dir() {
            return Err(format!("{}: no bus/pci/devices under it (expected a sysfs tree like /sys)", root.display()));
        }
        let devices = realpath(&root.join("devices")).unwrap_or_else(|| root.join("devices"));
        let mut devs: BTreeMap<String, PciDev> = BTreeMap::new();
        for name in sorted_names(&bus) {
            if let Some(d) = PciDev::read(&bus.join(&name), &devices) {
                devs.insert(d.bdf.clone(), d);
            }
        }
        let mut gpu_devs: Vec<&PciDev> = devs.values().filter(|d| d.is_gpu()).collect();
        gpu_devs.sort_by_key(|d| bdf_key(&d.bdf));
        let nics = load_nics(root, &devs, &devices);
        let nodes = load_nodes(root);
        let (view, cuda_source) = cuda_view(gpus, root)?;
        let mut out: Vec<Gpu> = match view {
            None => gpu_devs.iter().enumerate().map(|(i, d)| Gpu { pci: (*d).clone(), ordinal: i as i64, uuid: None }).collect(),
            Some(view) => gpu_devs
                .iter()
                .filter_map(|d| view.iter().find(|e| e.2 == d.bdf).map(|e| Gpu { pci: (*d).clone(), ordinal: e.0, uuid: e.1.clone() }))
                .collect(),
        };
        out.sort_by_key(|g| g.ordinal);
        let hints = match hints {
            Some(h) => load_hints(h)?,
            None => Vec::new(),
        };
        Ok(Topology { gpus: out, nics, nodes, cuda_source, hints })
    }

    /// The PCI bus id of this process's CUDA ordinal `k`: through `visible`
    /// (`CUDA_VISIBLE_DEVICES`: indices or GPU UUID prefixes) when set, else the view's ordinal.
    pub fn gpu_bus_id(&self, k: usize, visible: Option<&str>) -> Option<String> {
        let by_ordinal = |o: i64| self.gpus.iter().find(|g| g.ordinal == o).map(|g| g.pci.bdf.clone());
        let Some(vis) = visible.map(str::trim).filter(|v| !v.is_empty()) else { return by_ordinal(k as i64) };
        let entries: Vec<&str> = vis.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
        let e = *entries.get(k)?;
        if e.bytes().all(|b| b.is_ascii_digit()) {
            return by_ordinal(e.parse().ok()?);
        }
        self.bus_of_key(e)
    }

    /// The bus id a GPU UUID (prefix) or PCI bus id names.
    fn bus_of_key(&self, e: &str) -> Option<String> {
        let e = e.trim();
        if e.to_ascii_uppercase().starts_with("GPU-") {
            let want = e.to_ascii_lowercase();
            let hits: Vec<&Gpu> =
                self.gpus.iter().filter(|g| g.uuid.as_ref().is_some_and(|u| u.to_ascii_lowercase().starts_with(&want))).collect();
            return (hits.len() == 1).then(|| hits[0].pci.bdf.clone());
        }
        // a MIG UUID needs nvidia-smi -L (topology.py); the plugin does not read it
        normalize_bus_id(e)
    }

    /// The bus id of the GPU whose UUID is `uuid` (the CUDA runtime's view of an ordinal).
    pub fn bus_of_uuid(&self, uuid: &str) -> Option<String> {
        self.gpus.iter().find(|g| g.uuid.as_ref().is_some_and(|u| u.eq_ignore_ascii_case(uuid))).map(|g| g.pci.bdf.clone())
    }

    fn numa_class(&self, node: i32, nic: &Nic) -> Class {
        if nic.pci.numa >= 0 {
            return if nic.pci.numa == node { Class::Node } else { Class::Sys };
        }
        let cpus = self.nodes.get(&node).map(Vec::as_slice).unwrap_or(&[]);
        if !nic.pci.cpus.is_empty() && !cpus.is_empty() {
            return if intersects(&nic.pci.cpus, cpus) { Class::Node } else { Class::Sys };
        }
        if self.nodes.len() <= 1 {
            Class::Node
        } else {
            Class::Sys
        }
    }
}

fn load_nics(r: &Path, devs: &BTreeMap<String, PciDev>, devices: &Path) -> Vec<Nic> {
    let mut found: BTreeMap<String, Found> = BTreeMap::new();
    let ib = r.join("class/infiniband");
    for name in sorted_names(&ib) {
        let Some(dev) = pci_dir_of(&ib.join(&name).join("device")) else { continue };
        let Some(bdf) = dev.file_name().and_then(|n| normalize_bus_id(&n.to_string_lossy())) else { continue };
        let port = ib.join(&name).join("ports/1");
        let e = found.entry(bdf).or_default();
        if e.rdma.is_none() {
            let state = read(&port.join("state")).filter(|s| !s.is_empty());
            e.rdma = Some(name.clone());
            e.hca_type = read(&ib.join(&name).join("hca_type"));
            e.port_state = state.map(|s| s.rsplit(':').next().unwrap_or("").trim().to_ascii_uppercase());
            e.rate = read(&port.join("rate")).and_then(|t| number_before(&t, "Gb/sec"));
            // RoCE: the port's own netdev (a LAG's bond0, not PF 0's enslaved netdev)
            if let Some(nd) = read(&port.join("gid_attrs/ndevs/0")).filter(|n| !n.is_empty()) {
                let net = r.join("class/net").join(&nd);
                if net.exists() && !net.join("master").exists() {
                    e.netdev = Some(nd);
                }
            }
        }
    }
    let net = r.join("class/net");
    for name in sorted_names(&net) {
        let Some(dev) = pci_dir_of(&net.join(&name).join("device")) else { continue };
        let Some(bdf) = dev.file_name().and_then(|n| normalize_bus_id(&n.to_string_lossy())) else { continue };
        let e = found.entry(bdf).or_default();
        if e.netdev.is_none() {
            e.netdev = Some(name.clone());
            if let Some(s) = read(&net.join(&name).join("speed")).and_then(|s| s.parse::<i64>().ok()) {
                e.speed = (s > 0).then(|| s as f64 / 1000.0);
            }
        }
    }
    let mut nics = Vec::new();
    for (bdf, e) in found {
        let pci = match devs.get(&bdf) {
            Some(d) => Some(d.clone()),
            None => PciDev::read(&r.join("bus/pci/devices").join(&bdf), devices),
        };
        let Some(pci) = pci.filter(|p| !p.is_gpu()) else { continue };
        let rate = e.rate.filter(|r| *r > 0.0).or(e.speed);
        nics.push(Nic { pci, netdev: e.netdev, rdma: e.rdma, hca_type: e.hca_type, port_state: e.port_state, rate_gbps: rate });
    }
    nics.sort_by_key(|n| bdf_key(&n.pci.bdf));
    nics
}

fn load_nodes(r: &Path) -> BTreeMap<i32, Vec<usize>> {
    let base = r.join("devices/system/node");
    let mut nodes = BTreeMap::new();
    for name in sorted_names(&base) {
        let Some(n) = name.strip_prefix("node").filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        let cpus = parse_cpulist(&read(&base.join(&name).join("cpulist")).unwrap_or_default());
        if let (Ok(n), false) = (n.parse::<i32>(), cpus.is_empty()) {
            nodes.insert(n, cpus);
        }
    }
    nodes
}

fn load_hints(file: &Path) -> Result<Vec<(String, Vec<String>)>, String> {
    let what = format!("hints file {}", file.display());
    let text = std::fs::read_to_string(file).map_err(|e| format!("{what}: {e}"))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{what}: bad JSON: {e}"))?;
    let bad = || format!("{what}: expected a JSON object {{\"<gpu pci bus id>\": [\"<nic name or pci address>\", ...]}}");
    let obj = v.as_object().ok_or_else(bad)?;
    obj.iter()
        .map(|(k, v)| {
            let names =
                v.as_array().ok_or_else(bad)?.iter().map(|x| x.as_str().map(str::to_string).ok_or_else(bad)).collect::<Result<_, _>>()?;
            Ok((k.clone(), names))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The CUDA view

type View = Option<Vec<CudaEntry>>;

fn cuda_view(gpus: Option<&Path>, root: &Path) -> Result<(View, String), String> {
    let Some(file) = gpus else {
        if realpath(root).is_some_and(|p| p == Path::new("/sys")) {
            return Ok(match nvidia_smi() {
                Some(text) => (Some(parse_gpu_csv(&text, "nvidia-smi")?), "nvidia-smi".into()),
                None => (None, "pci order (no nvidia-smi answer)".into()),
            });
        }
        return Ok((None, "pci order".into()));
    };
    let what = format!("gpus file {}", file.display());
    let text = std::fs::read_to_string(file).map_err(|e| format!("{what}: {e}"))?;
    let view = if text.trim_start().starts_with('[') { parse_gpu_json(&text, &what)? } else { parse_gpu_csv(&text, &what)? };
    Ok((Some(view), what))
}

/// `nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader`, within 20 s.
fn nvidia_smi() -> Option<String> {
    let mut child = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            _ => return None,
        }
    }
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut out).ok()?;
    Some(out)
}

fn entry(ordinal: &str, uuid: Option<String>, bus: &str, what: &str) -> Result<CudaEntry, String> {
    let o = ordinal.trim().parse::<i64>().map_err(|_| format!("{what}: ordinal {ordinal:?} is not an integer"))?;
    let b = normalize_bus_id(bus).ok_or_else(|| format!("{what}: not a PCI bus id: {bus:?} (expected DDDD:BB:DD.F)"))?;
    Ok((o, uuid.filter(|u| !u.is_empty()), b))
}

fn parse_gpu_csv(text: &str, what: &str) -> Result<Vec<CudaEntry>, String> {
    let rows: Vec<Vec<&str>> =
        text.lines().map(|l| l.split(',').map(str::trim).collect::<Vec<_>>()).filter(|r| r.iter().any(|c| !c.is_empty())).collect();
    let skip = usize::from(rows.first().is_some_and(|r| !r[0].bytes().all(|b| b.is_ascii_digit()) || r[0].is_empty()));
    rows[skip..]
        .iter()
        .map(|r| match r.as_slice() {
            [o, u, b, ..] => entry(o, Some(u.to_string()), b, what),
            _ => Err(format!("{what}: expected 'index, uuid, pci.bus_id' per line, got {r:?}")),
        })
        .collect()
}

fn parse_gpu_json(text: &str, what: &str) -> Result<Vec<CudaEntry>, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("{what}: bad JSON: {e}"))?;
    let list = v.as_array().ok_or_else(|| format!("{what}: expected a JSON list of {{ordinal, uuid, pci_bus_id}}"))?;
    list.iter()
        .map(|e| {
            let (Some(o), Some(b)) = (e.get("ordinal"), e.get("pci_bus_id").and_then(|b| b.as_str())) else {
                return Err(format!("{what}: each entry needs ordinal and pci_bus_id (and uuid), got {e}"));
            };
            let o = o.as_i64().map(|o| o.to_string()).or_else(|| o.as_str().map(str::to_string)).unwrap_or_else(|| o.to_string());
            entry(&o, e.get("uuid").and_then(|u| u.as_str()).map(str::to_string), b, what)
        })
        .collect()
}

/// A CUDA UUID's 16 bytes as nvidia-smi writes it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

// ---------------------------------------------------------------------------------------------
// Distance and the plan

fn intersects(a: &[usize], b: &[usize]) -> bool {
    a.iter().any(|x| b.binary_search(x).is_ok())
}

fn same_node(a: &PciDev, b: &PciDev) -> bool {
    if a.numa >= 0 && b.numa >= 0 {
        return a.numa == b.numa;
    }
    if !a.cpus.is_empty() && !b.cpus.is_empty() {
        return intersects(&a.cpus, &b.cpus);
    }
    true
}

/// The class of the path between two PCI functions, by path components.
pub fn classify(a: &PciDev, b: &PciDev) -> Class {
    let (pa, pb) = (&a.chain, &b.chain);
    let (ua, ub) = (&pa[..pa.len().saturating_sub(1)], &pb[..pb.len().saturating_sub(1)]);
    let n = ua.iter().zip(ub).take_while(|(x, y)| x == y).count();
    if n >= 2 {
        let (below_a, below_b) = (pa.len() - 1 - n, pb.len() - 1 - n);
        return if below_a <= 1 && below_b <= 1 { Class::Pix } else { Class::Pxb };
    }
    if n == 1 && is_root_comp(&pa[0]) {
        return Class::Phb;
    }
    if same_node(a, b) {
        Class::Node
    } else {
        Class::Sys
    }
}

/// One chosen NIC of a tier.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Index into [`Topology::nics`].
    pub nic: usize,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tier {
    pub cls: Class,
    pub nics: Vec<Choice>,
}

/// Tiers per GPU (by PCI bus id) and per NUMA node (with CPUs).
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub gpus: BTreeMap<String, Vec<Tier>>,
    pub numa: BTreeMap<i32, Vec<Tier>>,
}

fn gbps(v: Option<f64>) -> String {
    v.map_or("? Gbit/s".into(), |v| format!("{v} Gbit/s"))
}

impl Topology {
    /// topology.py's `rail_plan()` (no include, share="split").
    pub fn rail_plan(&self) -> Plan {
        let cands = self.candidates();
        let mut plan = Plan::default();
        for g in &self.gpus {
            let tiers = tiers(&self.nics, &cands, |n| classify(&g.pci, &n.pci));
            plan.gpus.insert(g.pci.bdf.clone(), tiers);
        }
        self.split_shared(&mut plan.gpus);
        for g in &self.gpus {
            let (Some(h), Some(t)) = (self.hint_tier(g, &cands), plan.gpus.get_mut(&g.pci.bdf)) else { continue };
            let keep: Vec<usize> = h.nics.iter().map(|c| c.nic).collect();
            let rest: Vec<Tier> = t
                .drain(..)
                .map(|mut t| {
                    t.nics.retain(|c| !keep.contains(&c.nic));
                    t
                })
                .filter(|t| !t.nics.is_empty())
                .collect();
            *t = std::iter::once(h).chain(rest).collect();
        }
        for &node in self.nodes.keys() {
            plan.numa.insert(node, tiers(&self.nics, &cands, |n| self.numa_class(node, n)));
        }
        plan
    }

    /// The hint file's tier for `g` (the last key naming it), its NICs among the candidates.
    fn hint_tier(&self, g: &Gpu, cands: &[usize]) -> Option<Tier> {
        let names = self.hints.iter().rev().find(|(k, _)| self.bus_of_key(k).as_deref() == Some(g.pci.bdf.as_str()))?;
        let mut chosen = Vec::new();
        for want in &names.1 {
            for &i in cands {
                let n = &self.nics[i];
                let same_bdf = normalize_bus_id(want).as_deref() == Some(n.pci.bdf.as_str());
                if n.netdev.as_deref() == Some(want.as_str()) || n.rdma.as_deref() == Some(want.as_str()) || same_bdf {
                    chosen.push(Choice { nic: i, reason: Class::Hint.why().to_string() });
                }
            }
        }
        (!chosen.is_empty()).then_some(Tier { cls: Class::Hint, nics: chosen })
    }

    /// Why NIC `n` is out by kind (None: it is not); `down_ok` lets a port that is not ACTIVE in.
    fn kind_excluded(&self, n: &Nic, down_ok: bool) -> Option<&'static str> {
        if n.rdma.is_none() && self.nics.iter().any(|m| m.rdma.is_some()) {
            Some("no RDMA device while the host has RDMA NICs")
        } else if n.is_dpu() {
            Some("BlueField DPU function")
        } else if n.pci.physfn.as_ref().is_some_and(|pf| self.nics.iter().any(|m| &m.pci.bdf == pf)) {
            Some("SR-IOV VF of a NIC of this host")
        } else if n.pci.max_width == Some(1) {
            Some("PCIe x1: a management function")
        } else if n.port_state.as_ref().is_some_and(|s| s != "ACTIVE") && !down_ok {
            Some("RDMA port not ACTIVE")
        } else {
            None
        }
    }

    fn near(&self, g: &Gpu, n: &Nic) -> bool {
        classify(&g.pci, &n.pci) <= Class::Pxb
    }

    /// Indices of the NICs any location may use: by kind, then speed, then the storage rule.
    fn candidates(&self) -> Vec<usize> {
        let keep: Vec<usize> = (0..self.nics.len()).filter(|&i| self.kind_excluded(&self.nics[i], false).is_none()).collect();
        let widest = keep.iter().filter_map(|&i| self.nics[i].link_gbps()).fold(0.0, f64::max);
        let fast: Vec<usize> =
            keep.iter().copied().filter(|&i| !self.nics[i].link_gbps().is_some_and(|bw| widest > 0.0 && bw < widest / 4.0)).collect();
        let paired: Vec<usize> = fast.iter().copied().filter(|&i| self.gpus.iter().any(|g| self.near(g, &self.nics[i]))).collect();
        // a GPU with no NIC of its own at PXB or better (a down port counts) keeps the far NICs
        let own: Vec<usize> = fast
            .iter()
            .copied()
            .chain((0..self.nics.len()).filter(|i| !keep.contains(i) && self.kind_excluded(&self.nics[*i], true).is_none()))
            .collect();
        let lonely = self.gpus.iter().any(|g| !own.iter().any(|&i| self.near(g, &self.nics[i])));
        if paired.is_empty() || lonely {
            return fast;
        }
        paired
    }

    /// The shared-switch rule: G GPUs with the same best tier (PIX/PXB/PHB) of N >= G NICs
    /// split it by PCI address; the siblings' slices follow as a tier of the same class.
    fn split_shared(&self, tiers: &mut BTreeMap<String, Vec<Tier>>) {
        let mut groups: BTreeMap<(Class, Vec<String>), Vec<String>> = BTreeMap::new();
        for g in &self.gpus {
            let Some(first) = tiers.get(&g.pci.bdf).and_then(|t| t.first()) else { continue };
            if first.cls <= Class::Phb && first.nics.len() > 1 {
                let mut bdfs: Vec<String> = first.nics.iter().map(|c| self.nics[c.nic].pci.bdf.clone()).collect();
                bdfs.sort();
                groups.entry((first.cls, bdfs)).or_default().push(g.pci.bdf.clone());
            }
        }
        for ((cls, bdfs), mut members) in groups {
            let (gcount, ncount) = (members.len(), bdfs.len());
            if gcount < 2 || ncount < gcount {
                continue;
            }
            let mut ordered = bdfs;
            ordered.sort_by_key(|b| bdf_key(b));
            members.sort_by_key(|b| bdf_key(b));
            let per = ncount / gcount;
            for (i, bus) in members.iter().enumerate() {
                let Some(t) = tiers.get_mut(bus) else { continue };
                let lo = i * per;
                let hi = if i == gcount - 1 { ncount } else { lo + per };
                let mine = &ordered[lo..hi];
                let why = format!(
                    "shared-switch split: {gcount} GPUs share these {ncount} NICs; GPU {} of {gcount} takes NICs {}-{hi}",
                    i + 1,
                    lo + 1
                );
                let first = t.remove(0);
                let (own, sib): (Vec<Choice>, Vec<Choice>) = first.nics.into_iter().partition(|c| mine.contains(&self.nics[c.nic].pci.bdf));
                let own = own.into_iter().map(|c| Choice { reason: format!("{}; {why}", c.reason), ..c }).collect();
                let sib = sib
                    .into_iter()
                    .map(|c| Choice { reason: format!("{}; the other GPUs' share, used after this GPU's own", c.reason), ..c })
                    .collect();
                t.insert(0, Tier { cls, nics: sib });
                t.insert(0, Tier { cls, nics: own });
            }
        }
    }
}

/// The candidates by class, nearest first; SYS only when nothing nearer exists; within a tier
/// the fastest first, then PCI address.
fn tiers(nics: &[Nic], cands: &[usize], class_of: impl Fn(&Nic) -> Class) -> Vec<Tier> {
    let mut by: BTreeMap<Class, Vec<usize>> = BTreeMap::new();
    for &i in cands {
        by.entry(class_of(&nics[i])).or_default().push(i);
    }
    let nearer: usize = by.iter().filter(|(c, _)| **c != Class::Sys).map(|(_, v)| v.len()).sum();
    if nearer > 0 {
        by.remove(&Class::Sys);
    }
    Class::ALL
        .iter()
        .filter_map(|c| {
            let mut v = by.remove(c)?;
            v.sort_by(|&a, &b| {
                let (x, y) = (nics[a].link_gbps().unwrap_or(0.0), nics[b].link_gbps().unwrap_or(0.0));
                y.total_cmp(&x).then_with(|| bdf_key(&nics[a].pci.bdf).cmp(&bdf_key(&nics[b].pci.bdf)))
            });
            let choices = v
                .into_iter()
                .map(|i| Choice { nic: i, reason: format!("{}: {}; {}", c.name(), c.why(), gbps(nics[i].link_gbps())) })
                .collect();
            Some(Tier { cls: *c, nics: choices })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// For the tests and `mr_nixl_topology_json`

fn json_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

fn opt(s: &Option<String>) -> String {
    s.as_deref().map_or("null".into(), json_str)
}

impl Topology {
    fn tiers_json(&self, tiers: &[Tier]) -> String {
        let t: Vec<String> = tiers
            .iter()
            .map(|t| {
                let nics: Vec<String> = t
                    .nics
                    .iter()
                    .map(|c| {
                        let n = &self.nics[c.nic];
                        format!(
                            "{{\"pci\":{},\"netdev\":{},\"rdma\":{},\"reason\":{}}}",
                            json_str(&n.pci.bdf),
                            opt(&n.netdev),
                            opt(&n.rdma),
                            json_str(&c.reason)
                        )
                    })
                    .collect();
                format!("{{\"class\":\"{}\",\"nics\":[{}]}}", t.cls.name(), nics.join(","))
            })
            .collect();
        format!("[{}]", t.join(","))
    }

    /// The plan as JSON: `{"cuda_view", "gpus": {bus: tiers}, "numa": {node: tiers},
    /// "ordinals": {ordinal: bus}}`, each tier `{"class", "nics": [{pci, netdev, rdma, reason}]}`.
    pub fn plan_json(&self, plan: &Plan) -> String {
        let gpus: Vec<String> = plan.gpus.iter().map(|(b, t)| format!("{}:{}", json_str(b), self.tiers_json(t))).collect();
        let numa: Vec<String> = plan.numa.iter().map(|(n, t)| format!("\"{n}\":{}", self.tiers_json(t))).collect();
        let ords: Vec<String> = self.gpus.iter().map(|g| format!("\"{}\":{}", g.ordinal, json_str(&g.pci.bdf))).collect();
        format!(
            "{{\"cuda_view\":{},\"gpus\":{{{}}},\"numa\":{{{}}},\"ordinals\":{{{}}}}}",
            json_str(&self.cuda_source),
            gpus.join(","),
            numa.join(","),
            ords.join(",")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs attribute is a small regular file: a FIFO (which would block `createBackend`
    /// forever on its open) or a file beyond [`MAX_ATTR`] (`/dev/zero` would fill memory) in a
    /// tree under `MULTIRAIL_SYSFS_ROOT` reads as missing, at once.
    #[test]
    fn attributes_that_are_not_small_files_read_as_missing() {
        let dir = std::env::temp_dir().join(format!("mr-nixl-topo-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("speed"), "400\n").unwrap();
        let fifo = dir.join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let big = dir.join("big");
        std::fs::File::create(&big).unwrap().set_len(MAX_ATTR + 1).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            let _ = tx.send((read(&d.join("speed")), read(&d.join("fifo")), read(&d.join("big"))));
        });
        let got = rx.recv_timeout(Duration::from_secs(20));
        let _ = std::fs::remove_dir_all(&dir);
        let (speed, fifo, big) = got.expect("a read blocked (a FIFO was opened)");
        assert_eq!(speed.as_deref(), Some("400"));
        assert_eq!(fifo, None);
        assert!(big.is_none(), "a {} byte file was read", MAX_ATTR + 1);
    }

    /// A CPU list naming CPUs no kernel has (a corrupt or hostile tree under
    /// `MULTIRAIL_SYSFS_ROOT`, or an `affinity` setting's `cpus`) is malformed: refused, not
    /// expanded (`0-18446744073709551615` would fill memory inside `createBackend`).
    #[test]
    fn a_cpulist_beyond_any_cpu_is_refused() {
        for bad in ["0-4000000", "0-3,4000000", "0-18446744073709551615"] {
            assert!(parse_cpulist(bad).is_empty(), "{bad} gave {} CPUs", parse_cpulist(bad).len());
        }
        assert_eq!(parse_cpulist(&format!("0,{}", MAX_CPUS - 1)), vec![0, MAX_CPUS - 1]);
    }

    #[test]
    fn parsers_match_topology_py() {
        assert_eq!(normalize_bus_id("00000000:1B:00.0").as_deref(), Some("0000:1b:00.0"));
        assert_eq!(normalize_bus_id("1b:00.0").as_deref(), Some("0000:1b:00.0"));
        assert_eq!(normalize_bus_id("0008:01:00.0").as_deref(), Some("0008:01:00.0"));
        assert_eq!(normalize_bus_id("virtio0"), None);
        assert_eq!(parse_cpulist("0-2,5, 7"), vec![0, 1, 2, 5, 7]);
        assert_eq!(parse_cpulist("x"), Vec::<usize>::new());
        assert_eq!(number_before("32.0 GT/s PCIe", "GT/s"), Some(32.0));
        assert_eq!(number_before("Unknown", "GT/s"), None);
        assert_eq!(number_before("400 Gb/sec (4X NDR)", "Gb/sec"), Some(400.0));
        assert_eq!(pcie_gbps(Some(32.0), Some(16)), Some(504.1));
        assert_eq!(pcie_gbps(Some(2.5), Some(1)), Some(2.0));
        assert!(is_root_comp("pci0000:17") && !is_root_comp("0000:17:01.0"));
        assert!(bdf_key("0000:5a:00.0") > bdf_key("0000:59:00.1"));
        let u = [0x12u8, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(uuid_text(&u), "GPU-12345678-9abc-def0-0102-030405060708");
    }

    #[test]
    fn gpus_file_json_and_csv() {
        let j = parse_gpu_json(
            r#"[{"ordinal": 1, "uuid": "GPU-a", "pci_bus_id": "00000000:1B:00.0"}, {"ordinal": "0", "pci_bus_id": "2b:00.0"}]"#,
            "f",
        )
        .unwrap();
        assert_eq!(j, vec![(1, Some("GPU-a".into()), "0000:1b:00.0".into()), (0, None, "0000:2b:00.0".into())]);
        let c = parse_gpu_csv("index, uuid, pci.bus_id\n0, GPU-x, 00000000:1B:00.0\n\n", "f").unwrap();
        assert_eq!(c, vec![(0, Some("GPU-x".into()), "0000:1b:00.0".into())]);
        assert!(parse_gpu_json("[{\"ordinal\": 0}]", "f").unwrap_err().contains("pci_bus_id"));
        assert!(parse_gpu_csv("0, GPU-x\n", "f").is_err());
    }
}
