//! Which rails carry which memory (issue 34): the `affinity` setting (`MULTIRAIL_AFFINITY`)
//! turned into the engine's tiers per location (`Agent::set_topology`). The same setting as
//! the Python API's `AgentConfig.affinity` (python/multirail/affinity.py):
//!
//! * `auto` (default): with `rails=auto` and at least two rails, the topology of
//!   `$MULTIRAIL_SYSFS_ROOT` (default /sys) and the CUDA view of `$MULTIRAIL_TOPOLOGY_GPUS`
//!   (crate::topo): per GPU (`gpu:K`, K the CUDA ordinal this process sees: a VRAM descriptor's
//!   devId) and per NUMA node (`numa:N`, host memory) the plan's tiers restricted to this
//!   agent's rails (a NIC is a rail by netdev name or RDMA device name).
//! * `topology`: the same for any rail list.
//! * `none`: every transfer over every rail (the plugin's behaviour before).
//! * JSON, the Python dict's format: `{"gpu:0": [["eth0", "eth1"], ["eth2"]], "numa:0":
//!   ["eth2"], "cpus": {"eth0": "0-15"}}`, for any rail list.
//!
//! A topology that cannot be read, or that names none of the agent's rails, tiers nothing
//! (every rail serves all memory, as before); a bad JSON mapping fails the backend's creation.

use std::path::Path;

use multirail_proto::RailInfo;

use crate::topo::{Plan, Tier, Topology};

/// The parsed setting.
#[derive(Clone, Debug, PartialEq)]
pub enum Setting {
    Auto,
    Topology,
    None,
    Explicit(serde_json::Map<String, serde_json::Value>),
}

impl Setting {
    pub fn parse(text: &str) -> Result<Setting, String> {
        match text.trim() {
            "" | "auto" => Ok(Setting::Auto),
            "topology" => Ok(Setting::Topology),
            "none" => Ok(Setting::None),
            t if t.starts_with('{') => match serde_json::from_str::<serde_json::Value>(t) {
                Ok(serde_json::Value::Object(m)) => Ok(Setting::Explicit(m)),
                Ok(_) => Err("affinity: expected a JSON object of location -> tiers".into()),
                Err(e) => Err(format!("affinity: bad JSON: {e}")),
            },
            other => Err(format!("affinity: {other:?} is not auto, topology, none or a JSON object of location -> tiers")),
        }
    }
}

/// What `Agent::set_topology` takes, with each tier's class for the log line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chosen {
    pub tiers: Vec<(String, Vec<Vec<usize>>)>,
    pub classes: Vec<Vec<String>>,
    pub cpus: Vec<Vec<usize>>,
    pub source: String,
}

impl Chosen {
    /// `gpu:0: tier 0 PIX [a, b], tier 1 NODE [c]; numa:0: ...` (as `multirail bench` prints it).
    pub fn describe(&self, names: &[String]) -> String {
        let locs: Vec<String> = self
            .tiers
            .iter()
            .zip(&self.classes)
            .map(|((loc, ts), cls)| {
                let t: Vec<String> = ts
                    .iter()
                    .zip(cls)
                    .enumerate()
                    .map(|(i, (rails, c))| {
                        let n: Vec<&str> = rails.iter().map(|&r| names[r].as_str()).collect();
                        format!("tier {i} {c} [{}]", n.join(", "))
                    })
                    .collect();
                format!("{loc}: {}", t.join(", "))
            })
            .collect();
        locs.join("; ")
    }
}

/// `gpu:K` / `numa:N`, checked.
fn parse_loc(key: &str) -> Result<String, String> {
    match multirail::numa::Loc::parse(key) {
        Some(l) => Ok(l.label()),
        None => Err(format!("affinity: location {key:?} is not \"gpu:K\" or \"numa:N\"")),
    }
}

fn rail_index(item: &serde_json::Value, rails: &[RailInfo]) -> Result<usize, String> {
    let hit = match item {
        serde_json::Value::Number(n) => n.as_u64().map(|i| i as usize).filter(|&i| i < rails.len()),
        serde_json::Value::String(s) => rails.iter().position(|r| &r.name == s || &r.addr == s),
        _ => None,
    };
    let names: Vec<&str> = rails.iter().map(|r| r.name.as_str()).collect();
    hit.ok_or_else(|| format!("affinity names rail {item}, which is not one of this agent's rails {names:?}"))
}

/// The JSON mapping (python/multirail/affinity.py `_explicit`).
fn explicit(spec: &serde_json::Map<String, serde_json::Value>, rails: &[RailInfo], root: &Path) -> Result<Chosen, String> {
    if rails.is_empty() {
        return Err("affinity maps rails, but the agent has one default rail (set rails)".into());
    }
    let mut out = Chosen { source: "explicit".into(), ..Chosen::default() };
    for (key, val) in spec.iter().filter(|(k, _)| *k != "cpus") {
        let loc = parse_loc(key)?;
        let list = val.as_array().ok_or_else(|| format!("affinity {loc}: expected a list of tiers"))?;
        let flat = list.iter().all(|v| v.is_string() || v.is_number());
        let groups: Vec<serde_json::Value> = if flat { vec![val.clone()] } else { list.clone() };
        let (mut tiers, mut classes) = (Vec::new(), Vec::new());
        for (i, t) in groups.iter().enumerate() {
            let (items, cls) = match t {
                serde_json::Value::Object(o) => {
                    let cls = o.get("class").and_then(|c| c.as_str()).map_or(format!("tier{i}"), str::to_string);
                    (o.get("rails").cloned().unwrap_or_default(), cls)
                }
                other => (other.clone(), format!("tier{i}")),
            };
            let items = match items {
                serde_json::Value::Array(a) => a,
                serde_json::Value::Null => Vec::new(),
                one => vec![one],
            };
            let mut idx: Vec<usize> = Vec::new();
            for r in &items {
                let k = rail_index(r, rails)?;
                if !idx.contains(&k) {
                    idx.push(k);
                }
            }
            if !idx.is_empty() {
                tiers.push(idx);
                classes.push(cls);
            }
        }
        if !tiers.is_empty() {
            out.tiers.push((loc, tiers));
            out.classes.push(classes);
        }
    }
    out.cpus = match spec.get("cpus") {
        None | Some(serde_json::Value::Null) => sysfs_cpus(rails, root),
        Some(serde_json::Value::Object(m)) if m.is_empty() => sysfs_cpus(rails, root),
        Some(serde_json::Value::Object(m)) => {
            let mut cpus = vec![Vec::new(); rails.len()];
            for (k, v) in m {
                let i = rail_index(&serde_json::Value::String(k.clone()), rails)
                    .or_else(|_| k.parse::<u64>().map_err(|e| e.to_string()).and_then(|n| rail_index(&n.into(), rails)))?;
                cpus[i] = cpu_list(v).ok_or_else(|| format!("affinity cpus: {v} is not a CPU list"))?;
            }
            cpus
        }
        Some(_) => return Err("affinity cpus: expected {rail: cpu list}".into()),
    };
    Ok(out)
}

fn cpu_list(v: &serde_json::Value) -> Option<Vec<usize>> {
    match v {
        serde_json::Value::Array(a) => a.iter().map(|c| c.as_u64().map(|c| c as usize)).collect(),
        serde_json::Value::String(s) => {
            let l = crate::topo::parse_cpulist(s);
            (!l.is_empty() || s.trim().is_empty()).then_some(l)
        }
        _ => None,
    }
}

/// Each rail's NIC-local CPUs (`ROOT/class/{net,infiniband}/NAME/device/local_cpulist`; empty
/// when unknown: a veth, an address-only rail).
fn sysfs_cpus(rails: &[RailInfo], root: &Path) -> Vec<Vec<usize>> {
    rails
        .iter()
        .map(|r| {
            ["net", "infiniband"]
                .iter()
                .find_map(|c| crate::topo::read(&root.join("class").join(c).join(&r.name).join("device/local_cpulist")))
                .map(|t| crate::topo::parse_cpulist(&t))
                .unwrap_or_default()
        })
        .collect()
}

/// The plan's tiers as rail indices (a NIC is a rail by netdev name, or by RDMA device name).
fn rail_tiers(topo: &Topology, tiers: &[Tier], rails: &[RailInfo]) -> (Vec<Vec<usize>>, Vec<String>) {
    let (mut out, mut classes) = (Vec::new(), Vec::new());
    for t in tiers {
        let mut idx = Vec::new();
        for c in &t.nics {
            let n = &topo.nics[c.nic];
            for (i, r) in rails.iter().enumerate() {
                let by_name = n.netdev.as_deref() == Some(r.name.as_str());
                let by_rdma = !r.rdma_dev.is_empty() && n.rdma.as_deref() == Some(r.rdma_dev.as_str());
                if (by_name || by_rdma) && !idx.contains(&i) {
                    idx.push(i);
                }
            }
        }
        if !idx.is_empty() {
            out.push(idx);
            classes.push(t.cls.name().to_string());
        }
    }
    (out, classes)
}

/// Where this process's CUDA ordinals are: (process ordinal, bus id) for each ordinal the plan
/// can place. `cuda_uuids`: the CUDA runtime's UUID per ordinal, when it was asked and answered;
/// else the view's ordinals through `CUDA_VISIBLE_DEVICES`, as topology.py maps them.
pub fn gpu_locations(topo: &Topology, plan: &Plan, cuda_uuids: Option<&[String]>, visible: Option<&str>) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    if let Some(u) = cuda_uuids {
        for (k, uuid) in u.iter().enumerate() {
            if let Some(bus) = topo.bus_of_uuid(uuid).filter(|b| plan.gpus.contains_key(b)) {
                out.push((k, bus));
            }
        }
        if !out.is_empty() {
            return out;
        }
    }
    let mut ords: Vec<i64> = topo.gpus.iter().map(|g| g.ordinal).filter(|o| *o >= 0).collect();
    ords.sort_unstable();
    ords.dedup();
    for k in ords {
        if let Some(bus) = topo.gpu_bus_id(k as usize, visible).filter(|b| plan.gpus.contains_key(b)) {
            out.push((k as usize, bus));
        }
    }
    out
}

/// The environment a resolution reads (a closure, so tests give their own).
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The tiers for this agent, or None where nothing is tiered (every rail serves all memory).
/// `notes` gets what a user should know (an unreadable topology, no rail in the plan).
pub fn resolve(
    setting: &Setting,
    rails_auto: bool,
    rails: &[RailInfo],
    env: Env<'_>,
    cuda_uuids: &dyn Fn() -> Option<Vec<String>>,
    notes: &mut Vec<String>,
) -> Result<Option<Chosen>, String> {
    let root = env("MULTIRAIL_SYSFS_ROOT").filter(|r| !r.is_empty()).unwrap_or_else(|| "/sys".into());
    let root = Path::new(&root);
    match setting {
        Setting::None => return Ok(None),
        Setting::Explicit(m) => return explicit(m, rails, root).map(Some),
        Setting::Auto if !rails_auto => return Ok(None),
        _ if rails.len() < 2 => return Ok(None),
        _ => {}
    }
    let gpus = env("MULTIRAIL_TOPOLOGY_GPUS").filter(|g| !g.is_empty());
    let hints = env("MULTIRAIL_TOPOLOGY_HINTS").filter(|h| !h.is_empty());
    let topo = match Topology::load(root, gpus.as_deref().map(Path::new), hints.as_deref().map(Path::new)) {
        Ok(t) => t,
        Err(e) => {
            notes.push(format!("affinity: topology of {} unreadable ({e}); every rail serves all memory", root.display()));
            return Ok(None);
        }
    };
    let plan = topo.rail_plan();
    let uuids = if topo.gpus.iter().any(|g| g.uuid.is_some()) { cuda_uuids() } else { None };
    let visible = env("CUDA_VISIBLE_DEVICES");
    let mut out = Chosen { source: format!("topology of {} (CUDA view: {})", root.display(), topo.cuda_source), ..Chosen::default() };
    let gpu_locs = gpu_locations(&topo, &plan, uuids.as_deref(), visible.as_deref());
    let locs = gpu_locs
        .iter()
        .map(|(k, bus)| (format!("gpu:{k}"), &plan.gpus[bus]))
        .chain(plan.numa.iter().map(|(n, t)| (format!("numa:{n}"), t)));
    for (loc, tiers) in locs {
        let (t, c) = rail_tiers(&topo, tiers, rails);
        if !t.is_empty() {
            out.tiers.push((loc, t));
            out.classes.push(c);
        }
    }
    if out.tiers.is_empty() {
        notes.push(format!("affinity: no rail of this agent is in the plan of {}: every rail serves all memory", root.display()));
        return Ok(None);
    }
    out.cpus = sysfs_cpus(rails, root);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rail's `local_cpulist` that is a FIFO (a tree under `MULTIRAIL_SYSFS_ROOT`) reads as
    /// unknown at once instead of blocking `createBackend` on its open.
    #[test]
    fn a_local_cpulist_that_is_not_a_file_is_unknown() {
        let root = std::env::temp_dir().join(format!("mr-nixl-affinity-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for n in ["eth0", "eth1"] {
            std::fs::create_dir_all(root.join("class/net").join(n).join("device")).unwrap();
        }
        let fifo = root.join("class/net/eth0/device/local_cpulist");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        std::fs::write(root.join("class/net/eth1/device/local_cpulist"), "2-3\n").unwrap();
        let rails = vec![rail("eth0", "10.0.0.1"), rail("eth1", "10.0.1.1")];
        let (tx, rx) = std::sync::mpsc::channel();
        let r = root.clone();
        std::thread::spawn(move || {
            let _ = tx.send(sysfs_cpus(&rails, &r));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(got.expect("reading a FIFO blocked"), vec![vec![], vec![2, 3]]);
    }

    fn rail(name: &str, addr: &str) -> RailInfo {
        RailInfo {
            name: name.into(),
            addr: addr.into(),
            prefix_len: 24,
            port: 0,
            speed_mbps: 0,
            mtu: 1500,
            numa: -1,
            rdma_dev: String::new(),
        }
    }

    #[test]
    fn setting_parses_and_refuses_junk() {
        assert_eq!(Setting::parse("auto").unwrap(), Setting::Auto);
        assert_eq!(Setting::parse(" none ").unwrap(), Setting::None);
        assert_eq!(Setting::parse("topology").unwrap(), Setting::Topology);
        assert!(Setting::parse("nearest").unwrap_err().contains("affinity"));
        assert!(Setting::parse("{\"gpu:0\": [").unwrap_err().contains("bad JSON"));
        assert!(Setting::parse("[1]").is_err());
    }

    #[test]
    fn explicit_mapping_by_name_address_and_index() {
        let rails = [rail("eth0", "10.0.0.1"), rail("eth1", "10.0.1.1"), rail("eth2", "10.0.2.1")];
        let Setting::Explicit(m) = Setting::parse(
            r#"{"gpu:0": [["eth0", "10.0.1.1"], {"class": "NODE", "rails": [2]}], "numa:1": ["eth2"], "cpus": {"eth0": "0-3"}}"#,
        )
        .unwrap() else {
            panic!("not explicit")
        };
        let mut notes = Vec::new();
        let c = resolve(&Setting::Explicit(m), false, &rails, &|_| None, &|| None, &mut notes).unwrap().unwrap();
        assert_eq!(c.tiers, vec![("gpu:0".to_string(), vec![vec![0, 1], vec![2]]), ("numa:1".to_string(), vec![vec![2]])]);
        assert_eq!(c.classes, vec![vec!["tier0".to_string(), "NODE".to_string()], vec!["tier0".to_string()]]);
        assert_eq!(c.cpus, vec![vec![0, 1, 2, 3], vec![], vec![]]);
        let names: Vec<String> = rails.iter().map(|r| r.name.clone()).collect();
        assert_eq!(c.describe(&names), "gpu:0: tier 0 tier0 [eth0, eth1], tier 1 NODE [eth2]; numa:1: tier 0 tier0 [eth2]");
        let Setting::Explicit(bad) = Setting::parse(r#"{"gpu:0": ["eth9"]}"#).unwrap() else { panic!() };
        assert!(resolve(&Setting::Explicit(bad), false, &rails, &|_| None, &|| None, &mut notes).unwrap_err().contains("eth9"));
        let Setting::Explicit(bad) = Setting::parse(r#"{"cpu:0": ["eth0"]}"#).unwrap() else { panic!() };
        assert!(resolve(&Setting::Explicit(bad), false, &rails, &|_| None, &|| None, &mut notes).unwrap_err().contains("cpu:0"));
    }

    /// A tree as the testbed writes it: GPU i (0000:i2:00.0) behind a switch on root bus i0
    /// with NIC i (netdev `nic{i}`, 0000:i3:00.0) on the same switch; one NUMA node.
    fn two_gpu_tree(root: &Path) {
        let dev = |p: &Path, vendor: &str, class: &str| {
            std::fs::create_dir_all(p).unwrap();
            for (k, v) in [("vendor", vendor), ("device", "0x1"), ("class", class), ("numa_node", "0"), ("local_cpulist", "0-3")] {
                std::fs::write(p.join(k), format!("{v}\n")).unwrap();
            }
            let link = root.join("bus/pci/devices").join(p.file_name().unwrap());
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            let rel = Path::new("../../..").join(p.strip_prefix(root).unwrap());
            std::os::unix::fs::symlink(rel, link).unwrap();
        };
        for i in 1..=2 {
            let sw = root.join(format!("devices/pci0000:{i}0/0000:{i}0:00.0"));
            dev(&sw, "0x1000", "0x060400");
            dev(&sw.join(format!("0000:{i}1:00.0")), "0x1000", "0x060400");
            dev(&sw.join(format!("0000:{i}1:00.0/0000:{i}2:00.0")), "0x10de", "0x030200");
            dev(&sw.join(format!("0000:{i}1:01.0")), "0x1000", "0x060400");
            let nic = sw.join(format!("0000:{i}1:01.0/0000:{i}3:00.0"));
            dev(&nic, "0x8086", "0x020000");
            let net = root.join(format!("class/net/nic{i}"));
            std::fs::create_dir_all(&net).unwrap();
            std::os::unix::fs::symlink(Path::new("../../..").join(nic.strip_prefix(root).unwrap()), net.join("device")).unwrap();
        }
        std::fs::create_dir_all(root.join("devices/system/node/node0")).unwrap();
        std::fs::write(root.join("devices/system/node/node0/cpulist"), "0-3\n").unwrap();
    }

    #[test]
    fn auto_tiers_each_gpus_memory_over_its_own_nic() {
        let dir = std::env::temp_dir().join(format!("mr-nixl-affinity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        two_gpu_tree(&dir);
        let rails = [rail("nic2", "10.0.2.1"), rail("nic1", "10.0.1.1"), rail("veth0", "10.0.9.1")];
        let root = dir.to_string_lossy().to_string();
        let env = |k: &str| match k {
            "MULTIRAIL_SYSFS_ROOT" => Some(root.clone()),
            _ => None,
        };
        let mut notes = Vec::new();
        let c = resolve(&Setting::Auto, true, &rails, &env, &|| None, &mut notes).unwrap().expect("tiers");
        // GPU 0 (PCI order) is 0000:12:00.0, next to nic1 (rail 1); GPU 1 next to nic2 (rail 0)
        let want = vec![
            ("gpu:0".to_string(), vec![vec![1], vec![0]]),
            ("gpu:1".to_string(), vec![vec![0], vec![1]]),
            ("numa:0".to_string(), vec![vec![1, 0]]),
        ];
        assert_eq!(c.tiers, want, "{notes:?}");
        assert_eq!(c.classes[0], vec!["PIX".to_string(), "NODE".to_string()]);
        assert_eq!(c.cpus, vec![vec![0, 1, 2, 3], vec![0, 1, 2, 3], vec![]]);
        // CUDA_VISIBLE_DEVICES=1: this process's GPU 0 is the second GPU
        let env_cvd = |k: &str| match k {
            "MULTIRAIL_SYSFS_ROOT" => Some(root.clone()),
            "CUDA_VISIBLE_DEVICES" => Some("1".to_string()),
            _ => None,
        };
        let c = resolve(&Setting::Auto, true, &rails, &env_cvd, &|| None, &mut notes).unwrap().expect("tiers");
        assert_eq!(c.tiers[0], ("gpu:0".to_string(), vec![vec![0], vec![1]]));
        assert!(!c.tiers.iter().any(|(l, _)| l == "gpu:1"));
        // with UUIDs in the view, the CUDA runtime's order wins (here: reversed)
        let gpus = dir.join("gpus.json");
        std::fs::write(&gpus, r#"[{"ordinal": 0, "uuid": "GPU-a", "pci_bus_id": "0000:12:00.0"}, {"ordinal": 1, "uuid": "GPU-b", "pci_bus_id": "0000:22:00.0"}]"#).unwrap();
        let g = gpus.to_string_lossy().to_string();
        let env_uuid = |k: &str| match k {
            "MULTIRAIL_SYSFS_ROOT" => Some(root.clone()),
            "MULTIRAIL_TOPOLOGY_GPUS" => Some(g.clone()),
            _ => None,
        };
        let uuids = || Some(vec!["GPU-b".to_string(), "GPU-a".to_string()]);
        let c = resolve(&Setting::Auto, true, &rails, &env_uuid, &uuids, &mut notes).unwrap().expect("tiers");
        assert_eq!(c.tiers[0], ("gpu:0".to_string(), vec![vec![0], vec![1]]));
        assert_eq!(c.tiers[1], ("gpu:1".to_string(), vec![vec![1], vec![0]]));
        // no rail of the agent in the plan: nothing tiered
        let none = [rail("veth0", "10.0.9.1"), rail("veth1", "10.0.8.1")];
        assert_eq!(resolve(&Setting::Topology, false, &none, &env, &|| None, &mut notes), Ok(None));
        assert!(notes.last().is_some_and(|n| n.contains("no rail")), "{notes:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn auto_needs_auto_rails_and_a_readable_topology() {
        let rails = [rail("eth0", "10.0.0.1"), rail("eth1", "10.0.1.1")];
        let mut notes = Vec::new();
        let env = |k: &str| (k == "MULTIRAIL_SYSFS_ROOT").then(|| "/nonexistent-mr-sysfs".to_string());
        // an explicit rail list wins over auto; none is none
        assert_eq!(resolve(&Setting::Auto, false, &rails, &env, &|| None, &mut notes), Ok(None));
        assert_eq!(resolve(&Setting::None, true, &rails, &env, &|| None, &mut notes), Ok(None));
        assert!(notes.is_empty());
        // an unreadable topology tiers nothing, and says so
        assert_eq!(resolve(&Setting::Auto, true, &rails, &env, &|| None, &mut notes), Ok(None));
        assert!(notes[0].contains("unreadable"), "{notes:?}");
        // one rail: nothing to choose
        assert_eq!(resolve(&Setting::Topology, false, &rails[..1], &env, &|| None, &mut notes), Ok(None));
    }
}
