//! Connecting in the background (`Config::background_connect`, set by the NIXL backend): the
//! threads that prepare, post and send notifications never dial, probe or wait for a peer.
//!
//! Each peer has a [`Connector`]: a queue of what waits for a connection (posted transfers,
//! notifications, a prepare's request to connect) and, while the queue is not empty, a worker
//! thread (`mr-conn-<peer>`). The worker hands each job to the peer's live link in order; when
//! there is none it starts one dial (`Peer::connect_slot`, on a thread of its own so that the
//! worker still sees the deadlines while a dial hangs on a blackholed address). A job that has
//! no link `timeout` after it was queued fails (`Error::Timeout`: the peer may be alive; the
//! NIXL backend returns `NIXL_ERR_BACKEND`); a dial that fails fails every job queued (a refused
//! dial is `NIXL_ERR_REMOTE_DISCONNECT` there). A transfer released while it waits is never
//! started (`XferShared::post_gate`, as for the GPU-order waiter). The worker stays a second
//! after its queue empties, so a stream of notifications does not start a thread each.
//! Once connected, transfers and notifications go straight to the link only while the queue
//! is empty and the worker hands nothing over (`Connector::busy`), so that a notification
//! never overtakes one sent before it through the queue.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::Peer;
use crate::error::{Error, Result};
use crate::link::Link;
use crate::xfer::{XferShared, XferState};

/// How long an idle worker waits for more work before it exits.
const LINGER: Duration = Duration::from_secs(1);
/// Notifications handed to the link's notifier at once (`Link::send_notif`), which sends them pipelined.
const NOTIF_BATCH: usize = 32;

/// Something that waits for the peer's connection.
pub(crate) enum Job {
    /// Only connect (a prepare to a peer not connected yet).
    Connect,
    /// A posted transfer, handed to the link once there is one.
    Submit(Arc<XferShared>),
    /// A notification (`Peer::send_notif`).
    Notif(Vec<u8>),
}

impl Job {
    /// Whether it goes by the peer's tcp link for GPU memory (`Peer::gpu_link`).
    fn gpu(&self) -> bool {
        matches!(self, Job::Submit(x) if x.via_gpu_link() && !x.unsettled())
    }
}

#[derive(Default)]
struct State {
    /// Jobs in order, each with its deadline.
    jobs: VecDeque<(Job, Instant)>,
    /// A worker thread runs.
    worker: bool,
    /// A dial is under way, and the outcome of the last one (for the worker).
    dialing: bool,
    dialed: Option<Result<()>>,
    /// The worker is handing jobs it took from the queue to the link (`run`).
    running: bool,
    /// Set by `close`: no more jobs; the queued ones fail with this.
    closed: Option<Error>,
}

#[derive(Default)]
pub(crate) struct Connector {
    st: Mutex<State>,
    cv: Condvar,
}

impl Connector {
    /// No dial running and no job waiting (tests).
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        let g = self.st.lock().expect("connector lock");
        !g.dialing && g.jobs.is_empty()
    }

    /// Whether jobs wait here or are being handed to the link: a transfer posted or a
    /// notification sent now must queue behind them, or its notification could reach the
    /// link's notifier before theirs (`Peer::send_notif`, `Peer::submit`).
    pub(crate) fn busy(&self) -> bool {
        let g = self.st.lock().expect("connector lock");
        g.running || !g.jobs.is_empty()
    }

    /// Queue `job` for `peer`, starting its worker if none runs. A `Connect` while anything is
    /// queued or dialing is already answered.
    pub(crate) fn defer(&self, peer: &Peer, job: Job) -> Result<()> {
        let mut g = self.st.lock().expect("connector lock");
        if let Some(e) = &g.closed {
            return Err(e.clone());
        }
        if matches!(job, Job::Connect) && (g.dialing || !g.jobs.is_empty()) {
            return Ok(());
        }
        if g.jobs.is_empty() && !g.dialing {
            // The outcome of a dial that ended after every job waiting for it had timed out
            // is nobody's: a job queued now (perhaps long after) dials afresh, not fail with it.
            g.dialed = None;
        }
        if !g.worker {
            let me = peer.me.upgrade().ok_or_else(|| Error::PeerLost { peer: peer.name.clone(), reason: "peer closed".into() })?;
            std::thread::Builder::new()
                .name(format!("mr-conn-{}", peer.name))
                .spawn(move || me.connector.work(&me))
                .map_err(|e| Error::io("spawn", e))?;
            g.worker = true;
        }
        g.jobs.push_back((job, Instant::now() + peer.ctx.cfg.timeout));
        self.cv.notify_all();
        Ok(())
    }

    /// No more jobs: the queued ones fail with `why`, the worker leaves.
    pub(crate) fn close(&self, why: Error) {
        self.st.lock().expect("connector lock").closed.get_or_insert(why);
        self.cv.notify_all();
    }

    /// The worker: runs until its queue has been empty for `LINGER` or the peer closes.
    fn work(&self, peer: &Arc<Peer>) {
        let mut g = self.st.lock().expect("connector lock");
        loop {
            if let Some(e) = g.closed.clone() {
                let jobs: Vec<Job> = g.jobs.drain(..).map(|j| j.0).collect();
                g.worker = false;
                drop(g);
                fail(peer, jobs, &e);
                return;
            }
            let now = Instant::now();
            if g.jobs.iter().any(|j| j.1 <= now) {
                let (late, keep): (VecDeque<_>, VecDeque<_>) = g.jobs.drain(..).partition(|j| j.1 <= now);
                g.jobs = keep;
                drop(g);
                let why = Error::Timeout(format!("peer {:?}: no connection within {:?}", peer.name, peer.ctx.cfg.timeout));
                fail(peer, late.into_iter().map(|j| j.0).collect(), &why);
                g = self.st.lock().expect("connector lock");
                continue;
            }
            if g.jobs.is_empty() {
                let (ng, to) = self.cv.wait_timeout(g, LINGER).expect("connector lock");
                g = ng;
                if to.timed_out() && g.jobs.is_empty() && g.closed.is_none() {
                    g.worker = false;
                    return;
                }
                continue;
            }
            if g.dialing {
                let first = g.jobs.iter().map(|j| j.1).min().unwrap_or(now);
                g = self.cv.wait_timeout(g, first.saturating_duration_since(now)).expect("connector lock").0;
                continue;
            }
            if let Some(Err(e)) = g.dialed.take() {
                let jobs: Vec<Job> = g.jobs.drain(..).map(|j| j.0).collect();
                drop(g);
                fail(peer, jobs, &e);
                g = self.st.lock().expect("connector lock");
                continue;
            }
            let gpu = g.jobs[0].0.gpu();
            match peer.live(gpu) {
                Err(e) => {
                    // The link knows the peer is gone for good (it restarted).
                    let jobs: Vec<Job> = g.jobs.drain(..).map(|j| j.0).collect();
                    drop(g);
                    fail(peer, jobs, &e);
                }
                Ok(Some(link)) => {
                    let mut batch = vec![g.jobs.pop_front().expect("a job").0];
                    if matches!(batch[0], Job::Notif(_)) {
                        while batch.len() < NOTIF_BATCH && matches!(g.jobs.front(), Some((Job::Notif(_), _))) {
                            batch.push(g.jobs.pop_front().expect("a job").0);
                        }
                    }
                    g.running = true;
                    drop(g);
                    run(peer, &link, batch);
                    self.st.lock().expect("connector lock").running = false;
                }
                Ok(None) => {
                    g.dialing = true;
                    let p = peer.clone();
                    let spawned = std::thread::Builder::new().name(format!("mr-dial-{}", peer.name)).spawn(move || {
                        let r = p.connect_slot(gpu).map(|_| ());
                        let mut g = p.connector.st.lock().expect("connector lock");
                        g.dialing = false;
                        g.dialed = Some(r);
                        p.connector.cv.notify_all();
                    });
                    if let Err(e) = spawned {
                        g.dialing = false;
                        g.dialed = Some(Err(Error::io("spawn", e)));
                    }
                    continue;
                }
            }
            g = self.st.lock().expect("connector lock");
        }
    }
}

/// Hand `batch` (one transfer or connect, or notifications in order) to the live `link`.
fn run(peer: &Peer, link: &Arc<Link>, batch: Vec<Job>) {
    for job in batch {
        match job {
            Job::Connect => {}
            Job::Submit(x) => {
                let _gate = x.post_gate.lock().expect("xfer lock");
                if x.state() != XferState::InProgress {
                    continue; // released while it waited
                }
                // Prepared before the first connection: settled on the main link (`Job::gpu`).
                let settled_now = x.unsettled();
                if settled_now {
                    peer.settle(&x, link);
                }
                let on = match settled_now && x.via_gpu_link() {
                    false => Ok(Some(link.clone())),
                    true => peer.live(true),
                };
                let r = match on {
                    Ok(Some(l)) => l.submit(x.clone(), false),
                    // Settled onto the tcp link for GPU memory, not up yet: queued for it.
                    Ok(None) => peer.connector.defer(peer, Job::Submit(x.clone())),
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    x.finish(Err(e));
                }
            }
            // Behind the link's other notifications (transfers' ones held included), in order.
            Job::Notif(msg) => {
                if let Err(e) = link.send_notif(msg, false) {
                    notif_failed(peer, &e);
                }
            }
        }
    }
}

/// Fail `jobs` with `why`: their transfers end in error (those still posted), their
/// notifications are reported lost.
fn fail(peer: &Peer, jobs: Vec<Job>, why: &Error) {
    for job in jobs {
        match job {
            Job::Connect => peer.ctx.log(&format!("peer {}: background connect failed: {why}", peer.name)),
            Job::Submit(x) => {
                let _gate = x.post_gate.lock().expect("xfer lock");
                if x.state() == XferState::InProgress {
                    x.finish(Err(why.clone()));
                }
            }
            Job::Notif(_) => notif_failed(peer, why),
        }
    }
}

/// A notification that `send_notif` queued could not be delivered: the caller has returned
/// already, so it is said on stderr (and in the agent's event log).
fn notif_failed(peer: &Peer, e: &Error) {
    let msg = format!("peer {}: a notification was not delivered: {e}", peer.name);
    peer.ctx.log(&msg);
    eprintln!("multirail: warning: {msg}");
}
