//! Backend parameters: what `create_backend("MULTIRAIL", params)` and the `MULTIRAIL_*`
//! environment variables set, turned into a runtime [`Config`].
//!
//! Precedence per key: the backend parameter, else its environment variable, else the default.
//! An unknown key or a bad value is an error naming the key (the backend then fails to
//! initialise; NIXL reports the creation as failed).

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::IpAddr;
use std::time::Duration;

use multirail::config::{Progress, RailSpec, TransportKind};
use multirail::Config;
use multirail_gpu::{GpuKind, PoolConfig};
use multirail_proto::Policy;

/// (key, environment variable, default shown by `get_plugin_params`, meaning).
pub const PARAMS: &[(&str, &str, &str, &str)] = &[
    (
        "rails",
        "MULTIRAIL_RAILS",
        "auto",
        "interfaces or IPv4 addresses, comma-separated, or 'auto' (every up, addressed, non-loopback interface with carrier; \
         127.0.0.1 on a host that has none); empty: one rail on `host`",
    ),
    ("host", "MULTIRAIL_HOST", "", "listen address of one rail when set and `rails` is not (0.0.0.0: rails=auto)"),
    ("port", "MULTIRAIL_PORT", "0", "side-channel port (0: any free port)"),
    ("transport", "MULTIRAIL_TRANSPORT", "auto", "auto, tcp or ucx (auto: ucx on rails with an RDMA device, else tcp)"),
    ("connections", "MULTIRAIL_CONNECTIONS", "1", "connections per rail per peer"),
    ("chunk_size", "MULTIRAIL_CHUNK_SIZE", "1048576", "planner chunk size in bytes (4 KiB to 64 MiB; K/M/KiB/MiB suffixes)"),
    ("stripe_threshold", "MULTIRAIL_STRIPE_THRESHOLD", "262144", "transfers at least this large are striped over rails"),
    ("policy", "MULTIRAIL_POLICY", "weighted", "weighted, round_robin or pinned:N"),
    ("auth_secret", "MULTIRAIL_SECRET", "", "shared secret for the handshake (empty: none)"),
    ("progress", "MULTIRAIL_PROGRESS", "adaptive", "adaptive, poll or block"),
    ("spin_us", "MULTIRAIL_SPIN_US", "200", "busy-poll budget in microseconds"),
    (
        "serve_spin_us",
        "MULTIRAIL_SERVE_SPIN_US",
        "1000",
        "busy-poll budget of a serving connection for its next request, microseconds",
    ),
    ("timeout", "MULTIRAIL_TIMEOUT", "10", "connect/handshake/request timeout, seconds"),
    ("stall_timeout", "MULTIRAIL_STALL_TIMEOUT", "0.5", "a busy rail with no progress for this long is declared down, seconds"),
    ("gpu", "MULTIRAIL_GPU", "cuda", "cuda or standin (host memory posing as a GPU: tests)"),
    ("staging_buffers", "MULTIRAIL_STAGING_BUFFERS", "4", "pinned bounce buffers per connection and direction (GPU memory)"),
    ("staging_buffer_size", "MULTIRAIL_STAGING_BUFFER_SIZE", "262144", "bytes per bounce buffer"),
    ("gpu_ipc", "MULTIRAIL_GPU_IPC", "1", "CUDA IPC between agents on one host (1/0)"),
    ("faults", "MULTIRAIL_FAULTS", "", "fault injection for failover tests, e.g. '1:kill@200ms+1s'"),
    (
        "fan_in_window",
        "MULTIRAIL_FAN_IN_WINDOW",
        "auto",
        "receive window per rail shared among the connections served: auto (from 16 connections on a rail, max(2 MiB, speed x 200 us)), off, or bytes up to 1 GiB (K/M/KiB/MiB suffixes)",
    ),
    (
        "affinity",
        "MULTIRAIL_AFFINITY",
        "auto",
        "rails per memory location: auto (with rails=auto: a GPU's memory over the NICs nearest it, host memory over its NUMA \
         node's, from the topology of $MULTIRAIL_SYSFS_ROOT, default /sys), topology (the same for any rail list), none (every \
         rail for all memory), or JSON {\"gpu:0\": [[\"eth0\"], [\"eth1\"]], \"numa:0\": [\"eth1\"]}",
    ),
];

fn env_of(key: &str) -> Option<&'static str> {
    PARAMS.iter().find(|p| p.0 == key).map(|p| p.1)
}

/// The settings after precedence; `effective` lists every key with the value in force.
pub struct Settings {
    pub cfg: Config,
    pub effective: Vec<(String, String)>,
    /// The `affinity` setting (crate::affinity).
    pub affinity: crate::affinity::Setting,
    /// The rails are `rails=auto`'s (not an explicit list): `affinity=auto` applies.
    pub rails_auto: bool,
}

fn parse_size(key: &str, s: &str) -> Result<u64, String> {
    multirail::config::parse_size(s).ok_or_else(|| format!("{key}: {s:?} is not a size in bytes"))
}

fn parse_f64(key: &str, s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(v),
        _ => Err(format!("{key}: {s:?} is not a positive number")),
    }
}

fn parse_bool(key: &str, s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("{key}: {s:?} is not a boolean (1/0, true/false)")),
    }
}

/// Build the runtime configuration from the backend parameters and the environment.
pub fn settings(params: &HashMap<String, String>, env: &dyn Fn(&str) -> Option<String>) -> Result<Settings, String> {
    for k in params.keys() {
        if env_of(k).is_none() {
            let known: Vec<&str> = PARAMS.iter().map(|p| p.0).collect();
            return Err(format!("unknown MULTIRAIL backend parameter {k:?} (known: {})", known.join(", ")));
        }
    }
    let mut effective = Vec::new();
    let mut get = |key: &str| -> String {
        let (_, var, default, _) = PARAMS.iter().find(|p| p.0 == key).expect("known key");
        let v = match params.get(key) {
            Some(v) => v.clone(),
            None => match env(var) {
                Some(v) => v,
                None if key == "auth_secret" => env("MULTIRAIL_AUTH_SECRET").unwrap_or_default(),
                None => default.to_string(),
            },
        };
        effective.push((key.to_string(), if key == "auth_secret" && !v.is_empty() { "<set>".into() } else { v.clone() }));
        v
    };
    let given = |key: &str| params.contains_key(key) || env_of(key).and_then(env).is_some();
    let (rails_given, host_given) = (given("rails"), given("host"));
    let host = get("host");
    let rails = get("rails");
    let (host, rails, rails_auto) = where_to_serve(host.trim(), rails.trim(), host_given, rails_given)?;
    let mut cfg = Config { host, ..Config::default() };
    cfg.port = get("port").trim().parse().map_err(|_| "port: not a port number".to_string())?;
    cfg.rails = rails;
    cfg.transport = {
        let t = get("transport");
        TransportKind::parse(t.trim()).ok_or(format!("transport: {t:?} is not auto, tcp or ucx"))?
    };
    cfg.connections = match get("connections").trim().parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => n,
        _ => return Err("connections: must be a whole number from 1 to 64".into()),
    };
    let chunk = parse_size("chunk_size", &get("chunk_size"))?;
    if !(4096..=multirail_proto::codec::MAX_CHUNK).contains(&chunk) {
        return Err("chunk_size: must be between 4 KiB and 64 MiB".into());
    }
    cfg.planner.chunk_size = chunk;
    cfg.planner.min_chunk = cfg.planner.min_chunk.min(chunk);
    cfg.planner.stripe_threshold = parse_size("stripe_threshold", &get("stripe_threshold"))?;
    cfg.planner.policy = {
        let p = get("policy");
        match p.trim() {
            "weighted" => Policy::Weighted,
            "round_robin" | "round-robin" | "rr" => Policy::RoundRobin,
            other => match other.strip_prefix("pinned:").and_then(|n| n.parse::<usize>().ok()) {
                Some(n) => Policy::Pinned(n),
                None => return Err(format!("policy: {p:?} is not weighted, round_robin or pinned:N")),
            },
        }
    };
    let secret = get("auth_secret");
    cfg.secret = if secret.is_empty() { None } else { Some(secret.into_bytes()) };
    cfg.progress = {
        let p = get("progress");
        Progress::parse(p.trim()).ok_or(format!("progress: {p:?} is not adaptive, poll or block"))?
    };
    let spin = get("spin_us").trim().parse::<f64>().map_err(|_| "spin_us: not a number".to_string())?;
    if !(0.0..=1e6).contains(&spin) {
        return Err("spin_us: must be between 0 and 1000000".into());
    }
    cfg.spin = Duration::from_secs_f64(spin / 1e6);
    let serve = get("serve_spin_us").trim().parse::<f64>().map_err(|_| "serve_spin_us: not a number".to_string())?;
    if !(0.0..=1e6).contains(&serve) {
        return Err("serve_spin_us: must be between 0 and 1000000".into());
    }
    cfg.serve_spin = Duration::from_secs_f64(serve / 1e6);
    cfg.timeout = Duration::from_secs_f64(parse_f64("timeout", &get("timeout"))?);
    // A blip is not a disconnect: NIXL answers NIXL_ERR_REMOTE_DISCONNECT by dropping the
    // peer's metadata, so transfers wait up to `timeout` for a rail to come back.
    cfg.hold_when_down = true;
    // No network I/O on the caller's thread (vLLM calls prepXfer, postXfer and genNotif on its
    // engine step loop): peers are dialled by their own threads (docs/nixl-plugin.md).
    cfg.background_connect = true;
    cfg.planner.stall_timeout = Duration::from_secs_f64(parse_f64("stall_timeout", &get("stall_timeout"))?);
    cfg.staging.gpu = {
        let g = get("gpu");
        GpuKind::parse(g.trim()).ok_or(format!("gpu: {g:?} is neither cuda nor standin"))?
    };
    let buffers = get("staging_buffers").trim().parse::<usize>().map_err(|_| "staging_buffers: not a number".to_string())?;
    if !(2..=64).contains(&buffers) {
        return Err("staging_buffers: must be between 2 and 64".into());
    }
    let bsize = parse_size("staging_buffer_size", &get("staging_buffer_size"))?;
    if !(4096..=multirail_proto::codec::MAX_CHUNK).contains(&bsize) {
        return Err("staging_buffer_size: must be between 4 KiB and 64 MiB".into());
    }
    cfg.staging.pool = PoolConfig { buffers, buffer_size: bsize };
    cfg.staging.ipc = parse_bool("gpu_ipc", &get("gpu_ipc"))?;
    cfg.faults = multirail::transport::faulty::Fault::parse_list(&get("faults")).map_err(|e| format!("faults: {e}"))?;
    let window = get("fan_in_window");
    cfg.fan_in_window = match multirail::FanInWindow::parse(&window) {
        Some(multirail::FanInWindow::Bytes(b)) if b > 1 << 30 => {
            return Err("fan_in_window: must be auto, off, or at most 1 GiB".into());
        }
        Some(w) => w,
        None => return Err(format!("fan_in_window: {window:?} is not auto, off, or a size like 2MiB")),
    };
    let affinity = crate::affinity::Setting::parse(&get("affinity"))?;
    Ok(Settings { cfg, effective, affinity, rails_auto })
}

/// The listen host and the rails, from the `host` and `rails` settings (`*_given`: set by a
/// backend parameter or its variable, not defaulted). The rule, so that a deployment that sets
/// nothing works across hosts and an address no other host can reach is never advertised by
/// accident (docs/nixl-plugin.md, "What a deployment must set"):
/// * `rails` given (not empty): those rails (an explicit loopback address is taken as asked); an
///   unspecified address (0.0.0.0) among them is refused: a peer cannot dial it.
/// * else `host` given: one rail on it; `0.0.0.0` (or `::`) means every interface, i.e.
///   `rails=auto`, which advertises each interface's own address.
/// * else, `rails` given empty: one rail on 127.0.0.1 (as asked);
/// * else `rails=auto`; on a host with no up, addressed, non-loopback interface (a container
///   with only `lo`), one rail on 127.0.0.1: no other host can reach this one anyway.
///
/// The third value: the rails are `auto`'s.
fn where_to_serve(host: &str, rails: &str, host_given: bool, rails_given: bool) -> Result<(String, Vec<RailSpec>, bool), String> {
    const LOOPBACK: &str = "127.0.0.1";
    if rails_given && !rails.is_empty() {
        let r = resolve_rails(rails)?;
        if let Some(u) = r.iter().find(|r| r.addr.is_unspecified()) {
            return Err(format!(
                "rails (MULTIRAIL_RAILS): {} is not an address a peer can dial; name the interfaces or their addresses, or use 'auto'",
                u.addr
            ));
        }
        let host = if host.is_empty() { LOOPBACK } else { host };
        return Ok((host.to_string(), r, rails == "auto"));
    }
    if host_given && !host.is_empty() {
        let unspecified = host.parse::<IpAddr>().map(|a| a.is_unspecified()).unwrap_or(false);
        if !unspecified {
            return Ok((host.to_string(), Vec::new(), false));
        }
        return resolve_rails("auto").map(|r| (LOOPBACK.to_string(), r, true)).map_err(|e| {
            format!("host (MULTIRAIL_HOST) {host}: serves every interface, but {e}; set MULTIRAIL_HOST to an address a peer can dial")
        });
    }
    if !rails_given && if_addrs()?.iter().any(|a| a.up && !a.loopback) {
        return Ok((LOOPBACK.to_string(), resolve_rails("auto")?, true));
    }
    Ok((LOOPBACK.to_string(), Vec::new(), false))
}

/// One IPv4 address of a local interface.
struct IfAddr {
    name: String,
    addr: IpAddr,
    prefix: u8,
    up: bool,
    loopback: bool,
}

fn if_addrs() -> Result<Vec<IfAddr>, String> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that we walk read-only and free once.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return Err(format!("getifaddrs: {}", std::io::Error::last_os_error()));
        }
        let mut p = head;
        while !p.is_null() {
            let ifa = &*p;
            if !ifa.ifa_addr.is_null() && (*ifa.ifa_addr).sa_family as i32 == libc::AF_INET {
                let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let addr = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                let prefix = if ifa.ifa_netmask.is_null() {
                    32
                } else {
                    u32::from_be((*(ifa.ifa_netmask as *const libc::sockaddr_in)).sin_addr.s_addr).count_ones() as u8
                };
                let name = CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
                let flags = ifa.ifa_flags as i32;
                out.push(IfAddr {
                    name,
                    addr: IpAddr::V4(addr),
                    prefix,
                    // Up with carrier (IFF_RUNNING: operstate up or unknown), as the Python
                    // API's `oper_up`: a cable out, or a bridge with no port (docker0 with no
                    // container, virbr0 with no VM), is no rail.
                    up: flags & libc::IFF_UP != 0 && flags & libc::IFF_RUNNING != 0,
                    loopback: flags & libc::IFF_LOOPBACK != 0,
                });
            }
            p = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    Ok(out)
}

fn sys_num(iface: &str, what: &str) -> Option<i64> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/{what}")).ok()?.trim().parse().ok()
}

fn rail(a: &IfAddr) -> RailSpec {
    RailSpec {
        name: a.name.clone(),
        addr: a.addr,
        prefix_len: a.prefix,
        speed_mbps: sys_num(&a.name, "speed").filter(|s| *s > 0).unwrap_or(0) as u64,
        mtu: sys_num(&a.name, "mtu").unwrap_or(1500) as u32,
        numa: sys_num(&a.name, "device/numa_node").unwrap_or(-1) as i32,
        rdma_dev: String::new(),
        bind_device: true,
    }
}

/// The native `rails` syntax: empty (one rail on `host`), "auto" (every up, addressed,
/// non-loopback interface), or interface names / IPv4 addresses, comma-separated.
pub fn resolve_rails(spec: &str) -> Result<Vec<RailSpec>, String> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Ok(Vec::new());
    }
    let addrs = if_addrs()?;
    if spec == "auto" {
        let mut seen = Vec::new();
        let rails: Vec<RailSpec> = addrs
            .iter()
            .filter(|a| a.up && !a.loopback)
            .filter(|a| {
                let fresh = !seen.contains(&a.name);
                seen.push(a.name.clone());
                fresh
            })
            .map(rail)
            .collect();
        if rails.is_empty() {
            return Err("rails: 'auto' found no up, addressed, non-loopback interface".into());
        }
        return Ok(rails);
    }
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (host, prefix) = match item.split_once('/') {
            Some((h, p)) => (h, Some(p.parse::<u8>().map_err(|_| format!("rails: bad prefix in {item:?}"))?)),
            None => (item, None),
        };
        if let Ok(ip) = host.parse::<IpAddr>() {
            match addrs.iter().find(|a| a.addr == ip) {
                Some(a) => out.push(rail(a)),
                None => out.push(RailSpec {
                    name: host.to_string(),
                    addr: ip,
                    prefix_len: prefix.unwrap_or(32),
                    speed_mbps: 0,
                    mtu: 1500,
                    numa: -1,
                    rdma_dev: String::new(),
                    bind_device: false,
                }),
            }
        } else {
            let a = addrs
                .iter()
                .find(|a| a.name == host)
                .ok_or_else(|| format!("rails: {host:?} is neither an IPv4 address nor an interface with an IPv4 address here"))?;
            out.push(rail(a));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn precedence_param_then_env_then_default() {
        let env = |k: &str| match k {
            "MULTIRAIL_CONNECTIONS" => Some("3".to_string()),
            "MULTIRAIL_CHUNK_SIZE" => Some("256KiB".to_string()),
            "MULTIRAIL_FAN_IN_WINDOW" => Some("2MiB".to_string()),
            _ => None,
        };
        let mut p = HashMap::new();
        p.insert("connections".to_string(), "2".to_string());
        let s = settings(&p, &env).unwrap();
        assert_eq!(s.cfg.connections, 2);
        assert_eq!(s.cfg.planner.chunk_size, 256 << 10);
        assert_eq!(s.cfg.fan_in_window, multirail::FanInWindow::Bytes(2 << 20));
        assert_eq!(settings(&HashMap::new(), &no_env).unwrap().cfg.fan_in_window, multirail::FanInWindow::Auto);
        assert_eq!(s.cfg.transport, TransportKind::Auto);
        assert!(s.effective.iter().any(|(k, v)| k == "chunk_size" && v == "256KiB"));
    }

    #[test]
    fn bad_input_names_the_key() {
        for (k, v) in [
            ("connections", "0"),
            ("chunk_size", "12"),
            ("policy", "fastest"),
            ("gpu", "tpu"),
            ("fan_in_window", "2GiB"),
            ("fan_in_window", "x"),
            ("serve_spin_us", "-1"),
            ("serve_spin_us", "soon"),
            ("nope", "1"),
        ] {
            let mut p = HashMap::new();
            p.insert(k.to_string(), v.to_string());
            let e = settings(&p, &no_env).err().unwrap();
            assert!(e.contains(k), "{e}");
        }
    }

    #[test]
    fn rails_by_address_and_interface() {
        let r = resolve_rails("127.0.0.1, lo").unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].name, "lo");
        assert!(resolve_rails("no-such-if0").is_err());
        assert_eq!(resolve_rails("10.9.8.7/24").unwrap()[0].prefix_len, 24);
        let s = settings(&HashMap::new(), &no_env).unwrap();
        assert!(s.effective.iter().any(|(k, v)| k == "auth_secret" && v.is_empty()));
    }

    /// Runs `f` on a thread in a fresh network namespace of its own (gone with the thread),
    /// after the `ip` commands `setup`. None when this host cannot (not root, no `ip`).
    fn in_own_netns<T: Send + 'static>(setup: &'static [&'static str], f: fn() -> T) -> Option<T> {
        std::thread::spawn(move || {
            // SAFETY: unshare only changes this thread's network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                eprintln!("skipped: unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
                return None;
            }
            for cmd in setup {
                let ok = std::process::Command::new("ip").args(cmd.split(' ')).status().map(|s| s.success());
                if !matches!(ok, Ok(true)) {
                    eprintln!("skipped: ip {cmd}: {ok:?}");
                    return None;
                }
            }
            // The kernel settles a bridge's carrier after its last port left: wait (bounded)
            // until `ip` shows mr-br (when there is one) NO-CARRIER.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                let out = std::process::Command::new("ip").args(["-o", "link", "show", "dev", "mr-br"]).output();
                if out.map_or(true, |o| !o.status.success() || String::from_utf8_lossy(&o.stdout).contains("NO-CARRIER")) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Some(f())
        })
        .join()
        .expect("netns thread")
    }

    #[test]
    fn auto_takes_no_interface_without_carrier() {
        // mr-nc is up with an address but its veth peer is down (no carrier: a cable out);
        // mr-br is a bridge with no port (docker0 with no container, virbr0 with no VM);
        // mr-ok is a veth whose peer is up (carrier).
        const NC: [&str; 3] =
            ["link add name mr-nc type veth peer name mr-nc-peer", "addr add 10.231.0.1/24 dev mr-nc", "link set mr-nc up"];
        const SETUP: &[&str] = &[
            NC[0],
            NC[1],
            NC[2],
            "link add name mr-br type bridge",
            "addr add 10.231.2.1/24 dev mr-br",
            "link set mr-br up",
            // a bridge that never had a port reports carrier; one whose last port left does not
            "link add name mr-bp type veth peer name mr-bp-peer",
            "link set mr-bp master mr-br",
            "link del mr-bp",
            "link add name mr-ok type veth peer name mr-ok-peer",
            "addr add 10.231.1.1/24 dev mr-ok",
            "link set mr-ok-peer up",
            "link set mr-ok up",
        ];
        let Some((auto, nothing_set)) = in_own_netns(SETUP, || {
            let auto: Vec<String> = resolve_rails("auto").unwrap().into_iter().map(|r| r.name).collect();
            let s = settings(&HashMap::new(), &no_env).unwrap();
            (auto, s.cfg.rails.into_iter().map(|r| r.name).collect::<Vec<String>>())
        }) else {
            return;
        };
        assert_eq!(auto, vec!["mr-ok".to_string()]);
        assert_eq!(nothing_set, vec!["mr-ok".to_string()]);
        // nothing with carrier besides lo: one rail on loopback, as on a host with nothing else
        let Some(rails) = in_own_netns(&NC, || settings(&HashMap::new(), &no_env).map(|s| s.cfg.rails.len())) else {
            return;
        };
        assert_eq!(rails, Ok(0));
    }

    #[test]
    fn defaults_serve_every_interface_and_unreachable_addresses_are_refused() {
        let with =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(v, _)| *v == k).map(|(_, x)| x.to_string());
        let others = if_addrs().unwrap().iter().any(|a| a.up && !a.loopback);
        // nothing set: rails=auto and transport=auto (loopback only on a host that has nothing else)
        let s = settings(&HashMap::new(), &no_env).unwrap();
        assert_eq!(s.cfg.transport, TransportKind::Auto);
        assert_eq!(!s.cfg.rails.is_empty(), others);
        assert!(s.cfg.rails.iter().all(|r| !r.addr.is_loopback() && !r.addr.is_unspecified()));
        // MULTIRAIL_HOST=0.0.0.0: every interface's own address, never 0.0.0.0
        match settings(&HashMap::new(), &with(&[("MULTIRAIL_HOST", "0.0.0.0")])) {
            Ok(s) => {
                assert!(others && !s.cfg.rails.is_empty());
                assert!(s.cfg.rails.iter().all(|r| !r.addr.is_unspecified()));
            }
            Err(e) => assert!(!others && e.contains("MULTIRAIL_HOST"), "{e}"),
        }
        // an explicit address is taken as asked, loopback included
        let s = settings(&HashMap::new(), &with(&[("MULTIRAIL_HOST", "127.0.0.1")])).unwrap();
        assert!(s.cfg.rails.is_empty() && s.cfg.host == "127.0.0.1");
        let s = settings(&HashMap::new(), &with(&[("MULTIRAIL_RAILS", "127.0.0.1")])).unwrap();
        assert_eq!(s.cfg.rails.len(), 1);
        // an unspecified rail address is refused, naming the setting
        let mut p = HashMap::new();
        p.insert("rails".to_string(), "0.0.0.0".to_string());
        let e = settings(&p, &no_env).err().unwrap();
        assert!(e.contains("rails") && e.contains("MULTIRAIL_RAILS"), "{e}");
    }
}
