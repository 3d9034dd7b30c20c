//! An agent's immutable identity and configuration, shared by every thread of it (`Ctx`), and
//! its event log. Below the peer, link and server that read it; above the transports, which are
//! handed what they need instead.

use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use crate::config::Config;
use crate::net::{Identity, LocalRail};
use crate::numa::Loc;
use crate::transport::select::Choice;
use crate::transport::ucx::UcxAgent;

/// Immutable identity and configuration shared by every thread of an agent.
pub struct Ctx {
    pub name: String,
    pub incarnation: u64,
    pub cfg: Config,
    pub rails: Vec<LocalRail>,
    pub bind_devices: bool,
    pub(crate) events: Mutex<VecDeque<String>>,
    pub(crate) started: Instant,
    /// Set first thing in `Agent::close`: no link is opened after it (a prepared handle that
    /// outlives the agent must not reconnect).
    pub closed: AtomicBool,
    /// UCX state when a rail runs ucx (also in `Shared::ucx`): links open ucx rails with it.
    pub(crate) ucx: Option<Arc<UcxAgent>>,
    /// Per local rail: the transport it runs and why (`transport::select::choose`).
    pub(crate) choices: Vec<Choice>,
    /// Which rails serve which memory, and where each rail's threads run
    /// (`Agent::set_topology`, once, before the first link): empty until set.
    pub(crate) topo: OnceLock<RailTopo>,
}

/// The rail choice per memory location (issue 34, docs/topology.md, "The engine").
#[derive(Debug, Clone, Default)]
pub struct RailTopo {
    /// Per location: tiers of local rail indices, nearest first. A transfer whose local memory
    /// is at a location listed here uses the first tier with a rail up.
    pub tiers: BTreeMap<Loc, Vec<Vec<usize>>>,
    /// Per local rail: its NIC's local CPUs, where the rail's threads run (empty: unknown, or
    /// not to be pinned).
    pub cpus: Vec<Vec<usize>>,
}

impl Ctx {
    /// This agent as a handshake names it (`net::dial`).
    pub(crate) fn identity(&self) -> Identity<'_> {
        Identity { name: &self.name, incarnation: self.incarnation, secret: self.cfg.secret.as_deref(), bind_devices: self.bind_devices }
    }

    /// Record a warning: a cliff that would otherwise look like success (CUDA IPC staged
    /// instead). On stderr whatever MULTIRAIL_LOG says, as `multirail WARNING ...`, and in the
    /// events like [`Ctx::log`]'s.
    pub fn warn(&self, msg: &str) {
        let line = format!("[{:>9.3}s] {}: WARNING: {msg}", self.started.elapsed().as_secs_f64(), self.name);
        eprintln!("multirail {line}");
        let mut ev = self.events.lock().expect("events lock");
        if ev.len() >= 1000 {
            ev.pop_front();
        }
        ev.push_back(line);
    }

    /// Record an event (rail down/up, refused peer); printed when MULTIRAIL_LOG is set.
    pub fn log(&self, msg: &str) {
        let line = format!("[{:>9.3}s] {}: {msg}", self.started.elapsed().as_secs_f64(), self.name);
        if std::env::var_os("MULTIRAIL_LOG").is_some() {
            eprintln!("multirail {line}");
        }
        let mut ev = self.events.lock().expect("events lock");
        if ev.len() >= 1000 {
            ev.pop_front();
        }
        ev.push_back(line);
    }
}
