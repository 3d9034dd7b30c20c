//! The target's side of UCX sessions: per `Role::UcxSession` connection a worker of its own on
//! the requested rail's context, progressed until the session ends; destroying it is the fence
//! (module docs of `transport::ucx`).

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use multirail_proto::{Body, Status};
use multirail_ucx::{ThreadMode, Worker};

use super::UcxAgent;

/// A refused session's message when the asked rail does not run ucx on this agent.
pub(crate) const NOT_ON_RAIL: &str = "this agent does not run the ucx transport on rail";
use crate::config::{Config, Progress};
use crate::wire::{self, WireError};

/// How long the target's session loop sleeps at most between checks of shutdown and fence flags
/// (both also abort the session socket, which wakes it at once).
const SESSION_TICK: Duration = Duration::from_millis(250);

/// A `wire` tick for the session's frames: gives up (an empty reason: just close) once `stop()`,
/// or with `late()`'s reason after `deadline`.
fn tick_until<'a>(
    stop: &'a impl Fn() -> bool,
    deadline: Instant,
    late: impl Fn() -> String + 'a,
) -> impl FnMut(bool) -> std::result::Result<(), String> + 'a {
    move |_| {
        if stop() {
            Err(String::new())
        } else if Instant::now() > deadline {
            Err(late())
        } else {
            Ok(())
        }
    }
}

/// Target side of one `Role::UcxSession` connection (already authenticated and registered in
/// the agent's table of served connections; the caller holds the connection's `apply` lock for the whole call). Reads
/// `UcxOpen`, creates a worker on that rail's context for this session only, answers
/// `UcxReady`, then progresses the worker (sleeping on its event fd and the socket) and answers
/// `UcxRkeys` until the socket hangs up, the agent shuts down or the session is fenced. The
/// worker is destroyed before this returns. `Err((status, msg))`: refuse with that (an empty
/// message means just close).
pub(crate) fn serve_session(
    cfg: &Config,
    shutdown: &AtomicBool,
    log: &dyn Fn(&str),
    agent: &UcxAgent,
    s: &mut TcpStream,
    fenced: &AtomicBool,
    who: &str,
) -> std::result::Result<(), (Status, String)> {
    let timeout = cfg.timeout;
    let stop = || shutdown.load(Ordering::Acquire) || fenced.load(Ordering::Acquire);
    let mut tick = tick_until(&stop, Instant::now() + timeout, || format!("no UcxOpen within {timeout:?}"));
    let rail = match wire::read_frame(s, &mut tick) {
        Ok((_, Body::UcxOpen { rail, addr: _ })) => rail as usize,
        Ok((_, other)) => return Err((Status::Unexpected, format!("expected UcxOpen, got {:?}", other.kind()))),
        Err(WireError::Decode(e)) => return Err((Status::Malformed, e.to_string())),
        Err(WireError::GaveUp(m)) => return Err((Status::Malformed, m)),
        Err(WireError::Io(_)) => return Err((Status::Ok, String::new())),
    };
    if rail >= agent.rails.len() {
        return Err((Status::Unexpected, format!("no rail {rail} here (this agent has {})", agent.rails.len())));
    }
    let Some(rc) = agent.rail(rail) else {
        // Chosen tcp here (auto without RDMA, or explicit): no UCX over TCP without asking.
        return Err((Status::Unexpected, format!("{NOT_ON_RAIL} {rail} (it runs tcp there)")));
    };
    let worker = Worker::new(&rc.ctx, ThreadMode::Serialized).map_err(|e| (Status::Internal, format!("ucx session worker: {e}")))?;
    agent.sessions.fetch_add(1, Ordering::SeqCst);
    let r = session_loop(cfg, shutdown, log, agent, s, &worker, rail, fenced, who);
    // The session's worker goes here: its connections close, nothing of the session can touch
    // memory after this (the caller releases the fence lock only afterwards).
    drop(worker);
    agent.sessions.fetch_sub(1, Ordering::SeqCst);
    r
}

#[allow(clippy::too_many_arguments)]
fn session_loop(
    cfg: &Config,
    shutdown: &AtomicBool,
    log: &dyn Fn(&str),
    agent: &UcxAgent,
    s: &mut TcpStream,
    worker: &Worker,
    rail: usize,
    fenced: &AtomicBool,
    who: &str,
) -> std::result::Result<(), (Status, String)> {
    let timeout = cfg.timeout;
    let stop = || shutdown.load(Ordering::Acquire) || fenced.load(Ordering::Acquire);
    let mut tick = tick_until(&stop, Instant::now() + timeout, || format!("UcxReady not sent within {timeout:?}"));
    let Some(rc) = agent.rail(rail) else { return Err((Status::Internal, format!("rail {rail} has no UCX context"))) };
    let addr = worker.address().map_err(|e| (Status::Internal, format!("ucx session worker address: {e}")))?;
    let ready = Body::UcxReady { addr: addr.into_bytes(), regions: agent.ready_regions(rail, None) };
    if wire::send(s, &ready, 0, &mut tick).is_err() {
        return Err((Status::Ok, String::new()));
    }
    log(&format!("ucx session from {who} on rail {rail} ({})", rc.devices));
    let fd = s.as_raw_fd();
    let spin = match cfg.progress {
        Progress::Block => Duration::ZERO,
        _ => cfg.spin,
    };
    let r = loop {
        if stop() {
            break Ok(());
        }
        // Serve like a TCP serving connection (`Config::progress`): after activity, keep
        // progressing the worker for `spin` (software RMA over tcp needs this side's progress, and
        // a wake-up from the event fd costs tens of microseconds on a busy host), then sleep.
        if spin > Duration::ZERO {
            let mut until = Instant::now() + spin;
            while Instant::now() < until && !stop() {
                match worker.progress() {
                    // Nothing ready: give the CPU to any other runnable thread first (a
                    // bulk stream keeps this loop spinning between its fragments, and on a
                    // busy host the threads it would starve are the transfer's own).
                    Ok(0) => std::thread::yield_now(),
                    Ok(_) => until = Instant::now() + spin,
                    Err(_) => break,
                }
            }
        }
        let mut fds = [libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }];
        if let Err(e) = worker.wait_for_events_or(SESSION_TICK, &mut fds) {
            log(&format!("ucx session from {who}: {e}"));
            break Ok(());
        }
        let rev = fds[0].revents;
        if rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL | libc::POLLRDHUP) != 0 {
            break Ok(());
        }
        if rev & libc::POLLIN == 0 {
            continue;
        }
        let mut op_tick = tick_until(&stop, Instant::now() + timeout, || format!("request not completed within {timeout:?}"));
        match wire::read_frame(s, &mut op_tick) {
            Ok((h, Body::UcxRkeys(ids))) => {
                let resp = Body::UcxReady { addr: Vec::new(), regions: agent.ready_regions(rail, Some(&ids)) };
                if wire::send(s, &resp, h.req_id, &mut op_tick).is_err() {
                    break Ok(());
                }
            }
            Ok((_, other)) => break Err((Status::Unexpected, format!("{:?} is not a ucx session request", other.kind()))),
            Err(WireError::Decode(e)) => break Err((Status::Malformed, e.to_string())),
            Err(WireError::GaveUp(m)) => break Err((Status::Malformed, m)),
            Err(WireError::Io(_)) => break Ok(()),
        }
    };
    r
}
