//! An agent's immutable identity and configuration, shared by every thread of it (`Ctx`), and
//! its event log. Below the peer, link and server that read it; above the transports, which are
//! handed what they need instead.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::Config;
use crate::net::{Identity, LocalRail};
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
}

impl Ctx {
    /// This agent as a handshake names it (`net::dial`).
    pub(crate) fn identity(&self) -> Identity<'_> {
        Identity { name: &self.name, incarnation: self.incarnation, secret: self.cfg.secret.as_deref(), bind_devices: self.bind_devices }
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
