//! Which transport carries each rail (docs/transports.md, "Per-rail choice"): a pure function
//! over what is known of the rail (its RDMA device) and of the loaded UCX (its transport
//! modules), so the rule is tested without a NIC or a UCX library.
//!
//! - `tcp`, `ucx` asked for a rail: that, reason "explicit". A ucx rail without RDMA (no RDMA
//!   device, or a UCX without an RDMA transport) runs UCX over its tcp transport, whose software
//!   RMA checks no memory bounds (docs/SECURITY.md): `Choice::unprotected` says so, and the agent
//!   logs one warning naming those rails.
//! - `auto`: ucx where the rail's NIC has an RDMA device **and** the loaded UCX has an RDMA
//!   transport (`ib`, `ib_*`, `mlx5`, `efa` modules); tcp elsewhere, with the reason. `auto`
//!   never picks UCX over TCP.
//! - No shared secret (`auth_secret`): UCX sessions are refused (issue 33: they hand
//!   peer-supplied worker addresses and rkeys to UCX, so only a MAC-checked session may), so
//!   [`require_secret`] turns `auto`'s ucx into tcp with the reason (the agent warns once) and
//!   refuses `ucx` asked for by name, naming the setting.

use crate::config::TransportKind;
use crate::error::{Error, Result};

/// What is known of one local rail.
#[derive(Debug, Clone, Copy)]
pub struct RailFacts<'a> {
    /// The rail's RDMA device (`RailSpec::rdma_dev`, or found in sysfs); empty: none.
    pub rdma_dev: &'a str,
}

/// What is known of UCX on this host.
#[derive(Debug, Clone)]
pub enum UcxFacts {
    /// Not loaded: no rail needed it (nothing asked for ucx, no RDMA device under `auto`).
    NotTried,
    /// Loading failed, with why.
    Failed(String),
    /// Loaded: a label for messages ("1.22.0 (libucx wheel)") and its transport modules
    /// (`multirail_ucx::LibInfo::modules`: `ib`, `ib_mlx5`, `rdmacm`, `cma`, `cuda`, ...).
    Loaded { label: String, modules: Vec<String> },
}

/// One rail's transport and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// `Tcp` or `Ucx` (never `Auto`).
    pub kind: TransportKind,
    /// For `rail_stats()["transport_reason"]` and `doctor`.
    pub reason: String,
    /// A ucx rail without RDMA: UCX over tcp, no memory bounds checked (docs/SECURITY.md).
    pub unprotected: bool,
}

/// The RDMA transports among UCX's modules.
pub fn rdma_modules(modules: &[String]) -> Vec<&str> {
    modules.iter().map(String::as_str).filter(|m| m.starts_with("ib") || m.starts_with("mlx5") || m.starts_with("efa")).collect()
}

/// The transport for a rail asked to run `asked` (see the module docs).
pub fn choose(asked: TransportKind, rail: RailFacts<'_>, ucx: &UcxFacts) -> Choice {
    let rdma_lanes = match ucx {
        UcxFacts::Loaded { modules, .. } => rdma_modules(modules),
        _ => Vec::new(),
    };
    match asked {
        TransportKind::Tcp => Choice { kind: TransportKind::Tcp, reason: "explicit".into(), unprotected: false },
        TransportKind::Ucx => {
            let unprotected = rail.rdma_dev.is_empty() || rdma_lanes.is_empty();
            let reason = if rail.rdma_dev.is_empty() {
                "explicit (no RDMA device: UCX over tcp, no memory bounds checks)".to_string()
            } else if rdma_lanes.is_empty() {
                "explicit (the loaded UCX has no RDMA transport: UCX over tcp, no memory bounds checks)".to_string()
            } else {
                "explicit".to_string()
            };
            Choice { kind: TransportKind::Ucx, reason, unprotected }
        }
        TransportKind::Auto => {
            let tcp = |reason: String| Choice { kind: TransportKind::Tcp, reason, unprotected: false };
            let dev = rail.rdma_dev;
            if dev.is_empty() {
                return tcp("auto: no RDMA device".into());
            }
            match ucx {
                UcxFacts::NotTried => tcp(format!("auto: RDMA device {dev}, but UCX was not loaded")),
                UcxFacts::Failed(why) => tcp(format!("auto: RDMA device {dev}, but no UCX could be loaded ({why})")),
                UcxFacts::Loaded { label, .. } if rdma_lanes.is_empty() => tcp(format!(
                    "auto: RDMA device {dev}, but the loaded UCX ({label}) has no RDMA transport (only tcp lanes; \
                     install the system UCX, e.g. libucx0, or set MULTIRAIL_UCX_LIB)"
                )),
                UcxFacts::Loaded { .. } => Choice {
                    kind: TransportKind::Ucx,
                    reason: format!("auto: RDMA device {dev}, UCX has {}", rdma_lanes.join("+")),
                    unprotected: false,
                },
            }
        }
    }
}

/// Apply the secret rule (module docs) to `choices` (one per rail, for `asked[i]`): without a
/// secret, an `auto` rail that would run ucx runs tcp instead (its reason says why), and a rail
/// asked to run `ucx` by name is an error naming `auth_secret`.
pub fn require_secret(asked: &[TransportKind], choices: Vec<Choice>, secret: bool) -> Result<Vec<Choice>> {
    if secret {
        return Ok(choices);
    }
    choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| match (c.kind, asked.get(i).copied().unwrap_or(TransportKind::Auto)) {
            (TransportKind::Ucx, TransportKind::Ucx) => Err(Error::InvalidArgument(format!(
                "rail {i} is asked to run transport \"ucx\", which needs a shared secret (auth_secret, or MULTIRAIL_SECRET) \
                 on both agents: a UCX session hands the peer's worker address and rkeys to UCX, so it is opened only over \
                 an authenticated, MAC-checked connection (docs/SECURITY.md). Set auth_secret, or use transport \"tcp\""
            ))),
            (TransportKind::Ucx, _) => Ok(Choice {
                kind: TransportKind::Tcp,
                reason: format!("{}; but no auth_secret is set and UCX sessions need one: tcp", c.reason),
                unprotected: false,
            }),
            _ => Ok(c),
        })
        .collect()
}

/// Load UCX as an agent does (`MULTIRAIL_UCX_LIB`, a system UCX with InfiniBand, the libucx
/// wheel: docs/ucx.md) and describe it for [`choose`].
pub fn load_ucx() -> Result<(multirail_ucx::Ucx, UcxFacts)> {
    let u = multirail_ucx::Ucx::load_with(&multirail_ucx::LoadOptions::from_env())
        .map_err(|e| Error::Unavailable(format!("cannot load UCX: {e}")))?;
    let i = u.info();
    let facts = UcxFacts::Loaded { label: format!("{} ({})", i.version_string, i.source), modules: i.modules.clone() };
    Ok((u, facts))
}

/// Whether choosing for rails asked to run `asked` (with these RDMA devices) needs UCX loaded.
pub fn needs_ucx(asked: &[(TransportKind, &str)]) -> bool {
    asked.iter().any(|(k, dev)| *k == TransportKind::Ucx || (*k == TransportKind::Auto && !dev.is_empty()))
}

/// The RDMA device behind network interface `netdev` (`/sys/class/net/<netdev>/device/infiniband/*`),
/// if any: what `rails="auto"` in Python finds too, for rails given by address or name only.
pub fn rdma_dev_of(netdev: &str) -> Option<String> {
    if netdev.is_empty() || netdev.contains('/') || netdev.starts_with('.') {
        return None;
    }
    let dir = std::path::Path::new("/sys/class/net").join(netdev).join("device/infiniband");
    let mut names: Vec<String> =
        std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33, item 2: without a secret, auto falls back to tcp (saying why) and an explicit
    /// ucx is refused naming the setting; with one, nothing changes.
    #[test]
    fn ucx_needs_a_secret() {
        let ib = UcxFacts::Loaded { label: "x".into(), modules: vec!["ib".into()] };
        let rdma = RailFacts { rdma_dev: "mlx5_0" };
        let auto = choose(TransportKind::Auto, rdma, &ib);
        assert_eq!(auto.kind, TransportKind::Ucx);
        let asked = [TransportKind::Auto, TransportKind::Tcp];
        let tcp = choose(TransportKind::Tcp, rdma, &ib);
        let got = require_secret(&asked, vec![auto.clone(), tcp.clone()], false).unwrap();
        assert_eq!(got[0].kind, TransportKind::Tcp);
        assert!(got[0].reason.contains("no auth_secret"), "{}", got[0].reason);
        assert_eq!(got[1], tcp);
        assert_eq!(require_secret(&asked, vec![auto.clone(), tcp.clone()], true).unwrap(), vec![auto, tcp.clone()]);
        let ucx = choose(TransportKind::Ucx, rdma, &ib);
        let e = require_secret(&[TransportKind::Ucx], vec![ucx.clone()], false).unwrap_err().to_string();
        assert!(e.contains("auth_secret") && e.contains("rail 0"), "{e}");
        assert_eq!(require_secret(&[TransportKind::Ucx], vec![ucx.clone()], true).unwrap(), vec![ucx]);
    }

    fn loaded(mods: &[&str]) -> UcxFacts {
        UcxFacts::Loaded { label: "1.22.0 (libucx wheel)".into(), modules: mods.iter().map(|m| m.to_string()).collect() }
    }

    #[test]
    fn auto_picks_ucx_only_with_an_rdma_device_and_an_rdma_ucx() {
        let rdma = RailFacts { rdma_dev: "mlx5_0" };
        let plain = RailFacts { rdma_dev: "" };
        let ib = loaded(&["cma", "ib", "ib_mlx5", "rdmacm"]);
        let wheel = loaded(&["cma", "cuda"]);
        let c = choose(TransportKind::Auto, rdma, &ib);
        assert_eq!(c.kind, TransportKind::Ucx);
        assert_eq!(c.reason, "auto: RDMA device mlx5_0, UCX has ib+ib_mlx5");
        assert!(!c.unprotected);
        // No RDMA device: tcp, whatever UCX can do (UCX over TCP is never picked by auto).
        for u in [&ib, &wheel, &UcxFacts::NotTried, &UcxFacts::Failed("x".into())] {
            let c = choose(TransportKind::Auto, plain, u);
            assert_eq!((c.kind, c.reason.as_str()), (TransportKind::Tcp, "auto: no RDMA device"));
        }
        // An RDMA device and the PyPI wheel (no verbs): tcp, saying why and what to install.
        let c = choose(TransportKind::Auto, rdma, &wheel);
        assert_eq!(c.kind, TransportKind::Tcp);
        assert!(c.reason.contains("has no RDMA transport") && c.reason.contains("libucx0"), "{}", c.reason);
        let c = choose(TransportKind::Auto, rdma, &UcxFacts::Failed("no libucp.so.0 found".into()));
        assert_eq!(c.kind, TransportKind::Tcp);
        assert!(c.reason.contains("no libucp.so.0 found"), "{}", c.reason);
        // EFA and the newer module names count as RDMA.
        assert_eq!(choose(TransportKind::Auto, RailFacts { rdma_dev: "rdmap0s6" }, &loaded(&["efa"])).kind, TransportKind::Ucx);
        assert_eq!(choose(TransportKind::Auto, rdma, &loaded(&["mlx5"])).kind, TransportKind::Ucx);
        // rdmacm alone is connection management, not a data transport.
        assert_eq!(choose(TransportKind::Auto, rdma, &loaded(&["rdmacm"])).kind, TransportKind::Tcp);
    }

    #[test]
    fn explicit_choices_stand_and_ucx_without_rdma_is_flagged() {
        let rdma = RailFacts { rdma_dev: "mlx5_1" };
        let plain = RailFacts { rdma_dev: "" };
        let ib = loaded(&["ib"]);
        let wheel = loaded(&[]);
        assert_eq!(
            choose(TransportKind::Tcp, rdma, &ib),
            Choice { kind: TransportKind::Tcp, reason: "explicit".into(), unprotected: false }
        );
        assert_eq!(
            choose(TransportKind::Ucx, rdma, &ib),
            Choice { kind: TransportKind::Ucx, reason: "explicit".into(), unprotected: false }
        );
        let c = choose(TransportKind::Ucx, plain, &ib);
        assert!(c.kind == TransportKind::Ucx && c.unprotected && c.reason.contains("no RDMA device"), "{c:?}");
        let c = choose(TransportKind::Ucx, rdma, &wheel);
        assert!(c.kind == TransportKind::Ucx && c.unprotected && c.reason.contains("no RDMA transport"), "{c:?}");
    }

    #[test]
    fn ucx_is_loaded_only_when_a_rail_may_use_it() {
        assert!(!needs_ucx(&[(TransportKind::Auto, ""), (TransportKind::Tcp, "mlx5_0")]));
        assert!(needs_ucx(&[(TransportKind::Auto, "mlx5_0")]));
        assert!(needs_ucx(&[(TransportKind::Tcp, ""), (TransportKind::Ucx, "")]));
        assert!(!needs_ucx(&[]));
    }

    #[test]
    fn rdma_dev_of_refuses_paths() {
        assert_eq!(rdma_dev_of("../etc"), None);
        assert_eq!(rdma_dev_of(""), None);
        assert_eq!(rdma_dev_of("lo"), None);
    }
}
