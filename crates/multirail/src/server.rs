//! Serving inbound connections: handshake, then metadata, notifications and one-sided
//! READ/WRITE against the registry.
//!
//! Every request is validated by `Registry::check_remote` before memory is touched. A refused
//! WRITE's payload is read into scratch and dropped, so the stream stays in sync and memory
//! outside valid requests is untouched. A peer that sends undecodable bytes gets an `Error`
//! frame and is disconnected; other connections are unaffected.
//!
//! Fencing: every served connection is registered under its `Hello` nonce. When an initiator
//! gives up on a rail it sends `Fence` with the nonces of that rail's connections (over another
//! connection); the connections named are aborted, and the reply goes out only once none of them
//! can write memory any more. WRITE payloads are applied under the connection's `apply` lock and
//! only while it is not fenced, so bytes that were still queued in the dead path (and reach this
//! host after the link returns) never land over data the reissue wrote since.

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use multirail_proto::codec::{Role, Status};
use multirail_proto::{AgentMeta, Body, DecodeError};

use crate::agent::Shared;
use crate::auth;
use crate::config::Progress;
use crate::peer::abort_socket;
use crate::registry::random_bytes;
use crate::wire::{self, WireError};

const TICK: Duration = Duration::from_millis(50);

/// One served connection, as known to `Fence`.
pub struct Served {
    /// The authenticated peer name; only that peer may fence the connection.
    peer: String,
    fenced: AtomicBool,
    /// Held while a WRITE payload is being applied to memory.
    apply: Mutex<()>,
    sock: TcpStream,
}

/// Removes a connection from the fence table when its serve loop ends (no memory access after).
struct Registered<'a> {
    sh: &'a Shared,
    id: [u8; 16],
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.sh.served.lock().expect("served lock").remove(&self.id);
    }
}

/// Abort `peer`'s connections named by `ids` and wait until none of them is applying a WRITE.
/// Unknown ids (already closed) and other peers' connections are skipped. Returns how many
/// connections were fenced.
fn fence(sh: &Shared, peer: &str, ids: &[[u8; 16]]) -> usize {
    let victims: Vec<Arc<Served>> = {
        let g = sh.served.lock().expect("served lock");
        ids.iter().filter_map(|id| g.get(id)).filter(|c| c.peer == peer).cloned().collect()
    };
    for c in &victims {
        c.fenced.store(true, Ordering::Release);
        // Purges whatever is still queued on the socket and wakes a reader blocked on it.
        abort_socket(&c.sock);
    }
    for c in &victims {
        drop(c.apply.lock().expect("apply lock"));
    }
    sh.fenced.fetch_add(victims.len(), Ordering::Relaxed);
    if !victims.is_empty() {
        sh.ctx.log(&format!("fenced {} connection(s) of {peer}", victims.len()));
    }
    victims.len()
}

/// Abort every served connection (at `Agent::close`): blocked reads and writes fail at once,
/// and no further request is served on any of them.
pub(crate) fn abort_all(sh: &Shared) {
    let all: Vec<Arc<Served>> = sh.served.lock().expect("served lock").values().cloned().collect();
    for c in all {
        c.fenced.store(true, Ordering::Release);
        abort_socket(&c.sock);
    }
}

pub fn accept_loop(sh: Arc<Shared>, l: TcpListener) {
    loop {
        let r = l.accept();
        if sh.shutdown.load(Ordering::Acquire) {
            return;
        }
        let Ok((s, _)) = r else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if sh.open_conns.load(Ordering::Acquire) >= sh.ctx.cfg.max_connections {
            let mut s = s;
            let _ = s.set_write_timeout(Some(TICK));
            let _ = wire::send(&mut s, &Body::Error { status: Status::Busy, msg: "too many connections".into() }, 0, &mut |_| {
                Err(String::new())
            });
            continue;
        }
        sh.open_conns.fetch_add(1, Ordering::AcqRel);
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new().name("mr-serve".into()).spawn(move || {
            serve(&sh2, s);
            sh2.open_conns.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            sh.open_conns.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn decode_status(e: &DecodeError) -> Status {
    match e {
        DecodeError::VersionMismatch { .. } => Status::VersionMismatch,
        DecodeError::BodyTooLarge { .. } | DecodeError::TooMany { .. } => Status::TooLarge,
        _ => Status::Malformed,
    }
}

/// Tell the peer why it is being dropped (best effort) and count the refusal.
fn refuse(sh: &Shared, s: &mut TcpStream, who: &str, status: Status, msg: String) {
    sh.refused.fetch_add(1, Ordering::Relaxed);
    sh.ctx.log(&format!("refused {who}: {status:?}: {msg}"));
    let _ = wire::send(s, &Body::Error { status, msg }, 0, &mut |_| Err(String::new()));
}

fn serve(sh: &Arc<Shared>, mut s: TcpStream) {
    let who = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(TICK));
    let _ = s.set_write_timeout(Some(TICK));
    let timeout = sh.ctx.cfg.timeout;
    let Some((role, peer_name, conn_id)) = handshake(sh, &mut s, &who) else {
        let _ = s.shutdown(Shutdown::Both);
        return;
    };
    let who = format!("{peer_name}@{who}");
    let Ok(sock) = s.try_clone() else {
        let _ = s.shutdown(Shutdown::Both);
        return;
    };
    let me = Arc::new(Served { peer: peer_name.clone(), fenced: AtomicBool::new(false), apply: Mutex::new(()), sock });
    {
        let mut g = sh.served.lock().expect("served lock");
        if g.contains_key(&conn_id) {
            drop(g);
            refuse(sh, &mut s, &who, Status::Unexpected, "connection id already in use".into());
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
        g.insert(conn_id, me.clone());
    }
    let _registered = Registered { sh, id: conn_id };
    // `Agent::close` sets `shutdown` before it aborts the connections in `served`: one
    // registered after that sees the flag here.
    if sh.shutdown.load(Ordering::SeqCst) {
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    if role == Role::UcxSession {
        serve_ucx(sh, &mut s, &me, &who);
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    let mut inb = wire::Inbound::new();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
    let spin = wire::SpinBudget::new(sh.ctx.cfg.spin);
    loop {
        // Idle between frames is fine; a frame, once started, must finish within `timeout`.
        let mut started_at: Option<Instant> = None;
        let mut tick = |started: bool| {
            if sh.shutdown.load(Ordering::Acquire) {
                return Err(String::new());
            }
            if started {
                let t = *started_at.get_or_insert_with(Instant::now);
                if t.elapsed() > timeout {
                    return Err(format!("frame not completed within {timeout:?}"));
                }
            }
            Ok(())
        };
        if sh.ctx.cfg.progress != Progress::Block && inb.unread() == 0 {
            // Busy-poll for the next request before sleeping in the kernel: a client in a
            // round-trip loop sends it within microseconds, and a wake-up costs more.
            let r = wire::spin_readable(fd, spin.get(), || {
                Ok::<bool, ()>(!sh.shutdown.load(Ordering::Acquire) && !me.fenced.load(Ordering::Acquire))
            });
            if let Ok(how) = r {
                spin.record(how);
            }
        }
        let (h, body) = match inb.read_frame(&mut s, &mut tick) {
            Ok(f) => f,
            Err(WireError::Decode(e)) => {
                refuse(sh, &mut s, &who, decode_status(&e), e.to_string());
                break;
            }
            Err(WireError::GaveUp(m)) => {
                if !m.is_empty() {
                    refuse(sh, &mut s, &who, Status::Malformed, m);
                }
                break;
            }
            Err(WireError::Io(_)) => break,
        };
        if sh.shutdown.load(Ordering::SeqCst) || me.fenced.load(Ordering::Acquire) {
            // Closing (or fenced): serve nothing more, touch no memory.
            break;
        }
        let t0 = Instant::now();
        let mut op_tick = |_: bool| {
            if sh.shutdown.load(Ordering::Acquire) || me.fenced.load(Ordering::Acquire) {
                Err(String::new())
            } else if t0.elapsed() > timeout {
                Err(format!("request not completed within {timeout:?}"))
            } else {
                Ok(())
            }
        };
        let r = match body {
            Body::ReadReq(op) => match sh.registry.check_remote(&op, false) {
                Ok(region) => {
                    let hdr = Body::Resp { status: Status::Ok, bulk_len: op.len, msg: String::new() }.encode(h.req_id);
                    // SAFETY: check_remote proved [offset, offset+len) lies in the region, and
                    // `region` holds it registered for the duration of the write.
                    let data = unsafe { std::slice::from_raw_parts(region.ptr(op.offset), op.len as usize) };
                    wire::write_full(&mut s, &[&hdr, data], &mut op_tick)
                }
                Err((status, msg)) => {
                    sh.refused.fetch_add(1, Ordering::Relaxed);
                    wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick)
                }
            },
            Body::WriteReq(op) => match sh.registry.check_remote(&op, true) {
                Ok(region) => {
                    let guard = me.apply.lock().expect("apply lock");
                    if me.fenced.load(Ordering::Acquire) {
                        break;
                    }
                    // SAFETY: as above; the region is registered read-write.
                    let dst = unsafe { std::slice::from_raw_parts_mut(region.ptr(op.offset), op.len as usize) };
                    let r = inb.read_into(&mut s, dst, &mut op_tick);
                    drop(guard);
                    r.and_then(|_| {
                        wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick)
                    })
                }
                Err((status, msg)) => {
                    sh.refused.fetch_add(1, Ordering::Relaxed);
                    inb.discard(&mut s, op.len, &mut op_tick)
                        .and_then(|_| wire::send(&mut s, &Body::Resp { status, bulk_len: 0, msg }, h.req_id, &mut op_tick))
                }
            },
            Body::Notif(msg) => {
                sh.notifs.lock().expect("notif lock").push((peer_name.clone(), msg));
                wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick)
            }
            Body::Fence(ids) => {
                fence(sh, &peer_name, &ids);
                wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick)
            }
            Body::Ping => wire::send(&mut s, &Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() }, h.req_id, &mut op_tick),
            Body::MetaGet => wire::send(&mut s, &Body::Meta(sh.metadata().encode()), h.req_id, &mut op_tick),
            Body::MetaPut(blob) => {
                let hint = s.peer_addr().ok().map(|a| a.ip());
                let resp = match AgentMeta::decode(&blob) {
                    Ok(meta) if meta.name != peer_name => Body::Resp {
                        status: Status::Unexpected,
                        bulk_len: 0,
                        msg: format!("metadata names {:?} but the connection is from {peer_name:?}", meta.name),
                    },
                    Ok(meta) => match sh.add_remote(meta, hint) {
                        Ok(_) => Body::Resp { status: Status::Ok, bulk_len: 0, msg: String::new() },
                        Err(e) => Body::Resp { status: Status::Malformed, bulk_len: 0, msg: e.to_string() },
                    },
                    Err(e) => Body::Resp { status: decode_status(&e), bulk_len: 0, msg: e.to_string() },
                };
                wire::send(&mut s, &resp, h.req_id, &mut op_tick)
            }
            other => {
                refuse(sh, &mut s, &who, Status::Unexpected, format!("{:?} is not a request", other.kind()));
                break;
            }
        };
        if r.is_err() {
            break;
        }
    }
    let _ = s.shutdown(Shutdown::Both);
}

/// A `Role::UcxSession` connection: the session's own UCX worker lives (and is progressed) in
/// `transport::ucx::serve_session` until the socket hangs up, the agent closes or the session is
/// fenced. The connection's `apply` lock is held for the worker's whole life: `fence` takes it
/// after aborting the socket, so a fence returns only once the worker is destroyed, and then no
/// late PUT of this session can land (the UCX fence).
fn serve_ucx(sh: &Shared, s: &mut TcpStream, me: &Served, who: &str) {
    let Some(ucx) = sh.ucx.as_ref() else {
        // Read the UcxOpen first (bounded), so the refusal is not lost to a reset.
        let deadline = Instant::now() + sh.ctx.cfg.timeout;
        let mut tick = |_: bool| if sh.shutdown.load(Ordering::Acquire) || Instant::now() > deadline { Err(String::new()) } else { Ok(()) };
        let _ = wire::read_frame(s, &mut tick);
        refuse(sh, s, who, Status::Unexpected, "this agent does not run the ucx transport".into());
        return;
    };
    let guard = me.apply.lock().expect("apply lock");
    if me.fenced.load(Ordering::Acquire) {
        return;
    }
    let r = crate::transport::ucx::serve_session(sh, ucx, s, &me.fenced, who);
    drop(guard);
    if let Err((status, msg)) = r {
        if !msg.is_empty() {
            refuse(sh, s, who, status, msg);
        }
    }
}

/// Hello -> Challenge -> Auth -> Welcome. Returns the peer's role, name and connection id (the
/// nonce of its `Hello`).
fn handshake(sh: &Shared, s: &mut TcpStream, who: &str) -> Option<(Role, String, [u8; 16])> {
    let deadline = Instant::now() + sh.ctx.cfg.timeout;
    let mut tick = |_: bool| {
        if sh.shutdown.load(Ordering::Acquire) {
            Err(String::new())
        } else if Instant::now() > deadline {
            Err("handshake timed out".to_string())
        } else {
            Ok(())
        }
    };
    let (role, name, client_nonce) = match wire::read_frame(s, &mut tick) {
        Ok((_, Body::Hello { role, name, nonce, .. })) => (role, name, nonce),
        Ok((_, other)) => {
            refuse(sh, s, who, Status::Unexpected, format!("expected Hello, got {:?}", other.kind()));
            return None;
        }
        Err(WireError::Decode(e)) => {
            refuse(sh, s, who, decode_status(&e), e.to_string());
            return None;
        }
        Err(WireError::GaveUp(m)) => {
            if !m.is_empty() {
                refuse(sh, s, who, Status::Malformed, m);
            }
            return None;
        }
        Err(WireError::Io(_)) => return None,
    };
    let nonce: [u8; 16] = random_bytes();
    let secret = sh.ctx.cfg.secret.as_deref();
    let ch = Body::Challenge { auth_required: secret.is_some(), incarnation: sh.ctx.incarnation, nonce, name: sh.ctx.name.clone() };
    wire::send(s, &ch, 0, &mut tick).ok()?;
    let mac = match wire::read_frame(s, &mut tick) {
        Ok((_, Body::Auth { mac })) => mac,
        Ok((_, other)) => {
            refuse(sh, s, who, Status::Unexpected, format!("expected Auth, got {:?}", other.kind()));
            return None;
        }
        Err(WireError::Decode(e)) => {
            refuse(sh, s, who, decode_status(&e), e.to_string());
            return None;
        }
        Err(_) => return None,
    };
    let reply = match secret {
        Some(secret) => {
            if !auth::proofs_equal(&mac, &auth::client_proof(secret, &nonce, &client_nonce, &name)) {
                refuse(sh, s, who, Status::AuthFailed, format!("{name:?} did not prove the shared secret"));
                return None;
            }
            auth::server_proof(secret, &client_nonce, &nonce, &sh.ctx.name)
        }
        None => [0u8; 32],
    };
    wire::send(s, &Body::Welcome { mac: reply }, 0, &mut tick).ok()?;
    Some((role, name, client_nonce))
}
