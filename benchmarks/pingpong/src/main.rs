//! `mr-pingpong`: the raw-TCP latency baseline for `multirail bench --baseline`.
//!
//! Model: one TCP connection with `TCP_NODELAY`. The client writes an N-byte message, the
//! server reads exactly N bytes and writes them back, the client reads exactly N bytes; the
//! time of that round trip is one sample. After `--warmup` unrecorded round trips, `--iters`
//! recorded ones are summarised as one JSON line on stdout (microseconds):
//! `{"size":4096,"iters":2000,"mode":"block","avg_us":..,"p50_us":..,"p99_us":..,"min_us":..,
//! "max_us":..,"client_cpu_pct":..}`.
//!
//! Wait modes (the same on both ends; pass the flag to server and client alike):
//! * `block` (default): blocking socket I/O; a waiting thread sleeps in the kernel.
//! * `poll` (`--poll`): both ends set the connected socket non-blocking and busy-poll it:
//!   `read()`/`write()` are retried on `WouldBlock` with `std::hint::spin_loop()` between
//!   tries, never sleeping and never calling poll(2). This is the like-for-like comparison
//!   for the engine's polling progress mode. A polling wait still ends: the clock is read
//!   every [`SPINS_PER_CLOCK_CHECK`] spins and the wait fails once it has lasted the idle
//!   timeout, so a vanished peer cannot make either end spin forever.
//!
//! Every wait for the peer is bounded: by the idle timeout on the server (`--idle-timeout`,
//! default 30 s) and by [`CLIENT_IDLE`] on the client, in both modes and for reads as well
//! as writes.
//!
//! `client_cpu_pct` is the CPU time of the client thread (user + system, from
//! `clock_gettime(CLOCK_THREAD_CPUTIME_ID)`) over the recorded round trips, divided by their
//! wall time, in percent: ~100 in poll mode, lower in block mode where the thread sleeps
//! while the message is in flight. It is `null` where the thread CPU clock is unavailable.
//!
//! Subcommands:
//! * `server --listen HOST:PORT [--size N] [--idle-timeout S] [--poll]`: prints
//!   `{"ready":true,"host":..,"port":..}` once listening, serves one client, then exits. It
//!   never waits longer than the idle timeout (default 30 s) for a connection or a message.
//! * `client --connect HOST:PORT [--size N] [--iters N] [--warmup N] [--poll]`
//! * `local [--size N] [--iters N] [--warmup N] [--poll]`: server thread on 127.0.0.1 plus
//!   client. In poll mode both threads spin, so this wants at least two free cores.
//!
//! Exit codes: 0 success, 1 runtime error (connect refused, timeout), 2 usage error.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

/// How a thread waits for its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Blocking socket, kernel read/write timeouts.
    Block,
    /// Non-blocking socket, busy-polled with `spin_loop`.
    Poll,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Block => "block",
            Mode::Poll => "poll",
        }
    }
}

/// Parsed command line options shared by all subcommands.
#[derive(Debug, Clone)]
struct Options {
    addr: Option<String>,
    size: usize,
    iters: usize,
    warmup: usize,
    idle_timeout: Duration,
    mode: Mode,
}

impl Default for Options {
    fn default() -> Self {
        Options { addr: None, size: 4096, iters: 2000, warmup: 200, idle_timeout: Duration::from_secs(30), mode: Mode::Block }
    }
}

/// A failure with the exit code it maps to.
#[derive(Debug)]
enum Failure {
    /// Bad command line (exit 2).
    Usage(String),
    /// I/O or timeout at run time (exit 1).
    Runtime(String),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Runtime(e.to_string())
    }
}

const USAGE: &str = "usage: mr-pingpong server --listen HOST:PORT [--size N] [--idle-timeout S] [--poll]\n       \
mr-pingpong client --connect HOST:PORT [--size N] [--iters N] [--warmup N] [--poll]\n       \
mr-pingpong local [--size N] [--iters N] [--warmup N] [--poll]";

/// Largest message accepted, so a typo cannot allocate gigabytes.
const MAX_SIZE: usize = 64 << 20;

/// The longest the client waits for the server to accept or return bytes.
const CLIENT_IDLE: Duration = Duration::from_secs(10);

/// A polling wait reads the clock once per this many unsuccessful tries.
const SPINS_PER_CLOCK_CHECK: u32 = 4096;

fn parse_num(flag: &str, value: Option<String>) -> Result<usize, Failure> {
    let v = value.ok_or_else(|| Failure::Usage(format!("{flag} needs a value")))?;
    v.parse::<usize>().map_err(|_| Failure::Usage(format!("{flag}: not a non-negative integer: {v:?}")))
}

fn parse_args(args: &[String]) -> Result<(String, Options), Failure> {
    let mut it = args.iter().cloned();
    let cmd = it.next().ok_or_else(|| Failure::Usage("missing subcommand".into()))?;
    let mut o = Options::default();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--listen" | "--connect" => o.addr = Some(it.next().ok_or_else(|| Failure::Usage(format!("{flag} needs HOST:PORT")))?),
            "--size" => o.size = parse_num(&flag, it.next())?,
            "--iters" => o.iters = parse_num(&flag, it.next())?,
            "--warmup" => o.warmup = parse_num(&flag, it.next())?,
            "--idle-timeout" => o.idle_timeout = Duration::from_secs(parse_num(&flag, it.next())? as u64),
            "--poll" => o.mode = Mode::Poll,
            "-h" | "--help" => return Err(Failure::Usage(String::new())),
            other => return Err(Failure::Usage(format!("unknown argument {other:?}"))),
        }
    }
    if o.size == 0 || o.size > MAX_SIZE {
        return Err(Failure::Usage(format!("--size must be 1..={MAX_SIZE}")));
    }
    if o.iters == 0 {
        return Err(Failure::Usage("--iters must be at least 1".into()));
    }
    if o.idle_timeout.is_zero() {
        return Err(Failure::Usage("--idle-timeout must be at least 1".into()));
    }
    Ok((cmd, o))
}

fn resolve(addr: &str) -> Result<SocketAddr, Failure> {
    addr.to_socket_addrs()
        .map_err(|e| Failure::Usage(format!("bad address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Failure::Usage(format!("address {addr:?} resolves to nothing")))
}

fn idle_error(idle: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("peer idle for {:.1} s", idle.as_secs_f64()))
}

/// Retries a non-blocking `op` until it stops failing with `WouldBlock` (or `Interrupted`),
/// spinning in between. Bounded: once per [`SPINS_PER_CLOCK_CHECK`] tries the clock is read,
/// and after `idle` (counted from the first such read) the wait fails with `TimedOut`.
fn spin_until_ready<T>(idle: Duration, mut op: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let mut spins_left = SPINS_PER_CLOCK_CHECK;
    let mut deadline: Option<Instant> = None;
    loop {
        match op() {
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {
                spins_left -= 1;
                if spins_left == 0 {
                    spins_left = SPINS_PER_CLOCK_CHECK;
                    let now = Instant::now();
                    match deadline {
                        None => deadline = Some(now + idle),
                        Some(d) if now >= d => return Err(idle_error(idle)),
                        Some(_) => {}
                    }
                }
                std::hint::spin_loop();
            }
            other => return other,
        }
    }
}

/// One connected socket and the way its owner waits for it.
struct Conn {
    stream: TcpStream,
    mode: Mode,
    idle: Duration,
}

impl Conn {
    /// Sets up `stream` for `mode`: `TCP_NODELAY`, and either blocking with `idle` as the
    /// kernel read and write timeout, or non-blocking for busy polling.
    fn new(stream: TcpStream, mode: Mode, idle: Duration) -> io::Result<Conn> {
        stream.set_nodelay(true)?;
        match mode {
            Mode::Block => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(idle))?;
                stream.set_write_timeout(Some(idle))?;
            }
            Mode::Poll => stream.set_nonblocking(true)?,
        }
        Ok(Conn { stream, mode, idle })
    }

    /// One read() of at least one byte (0 on EOF), waiting as the mode says.
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let stream = &mut self.stream;
        match self.mode {
            Mode::Poll => spin_until_ready(self.idle, || stream.read(buf)),
            Mode::Block => loop {
                match stream.read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    // A kernel timeout shows as EAGAIN (WouldBlock) on Unix.
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return Err(idle_error(self.idle)),
                    other => return other,
                }
            },
        }
    }

    /// One write() of at least one byte, waiting as the mode says.
    fn write_some(&mut self, buf: &[u8]) -> io::Result<usize> {
        let stream = &mut self.stream;
        match self.mode {
            Mode::Poll => spin_until_ready(self.idle, || stream.write(buf)),
            Mode::Block => loop {
                match stream.write(buf) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return Err(idle_error(self.idle)),
                    other => return other,
                }
            },
        }
    }

    /// Reads exactly `buf.len()` bytes. Ok(false) on EOF before the first byte.
    fn read_full(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            let n = self.read_some(&mut buf[got..])?;
            if n == 0 {
                if got == 0 {
                    return Ok(false);
                }
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed mid-message"));
            }
            got += n;
        }
        Ok(true)
    }

    /// Writes all of `buf`.
    fn write_full(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut sent = 0;
        while sent < buf.len() {
            match self.write_some(&buf[sent..])? {
                0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes")),
                n => sent += n,
            }
        }
        Ok(())
    }
}

/// Serves one client on an already bound listener: echo `size`-byte messages until EOF.
fn serve(listener: TcpListener, size: usize, idle: Duration, mode: Mode) -> Result<(), Failure> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + idle;
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Failure::Runtime(format!("no client within {} s", idle.as_secs())));
                }
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let mut conn = Conn::new(stream, mode, idle)?;
    let mut buf = vec![0u8; size];
    loop {
        match conn.read_full(&mut buf) {
            Ok(true) => conn.write_full(&buf)?,
            Ok(false) => return Ok(()), // clean EOF between messages: client is done
            Err(e) => return Err(e.into()),
        }
    }
}

/// CPU time (user + system) consumed so far by the calling thread, where the platform's
/// per-thread CPU clock is available.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn thread_cpu_time() -> Option<Duration> {
    // `struct timespec` on 64-bit Linux (glibc and musl): two 64-bit fields.
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock_id: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable `struct timespec` for the duration of the call, and
    // clock_gettime writes nothing else.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 || ts.tv_sec < 0 || !(0..1_000_000_000).contains(&ts.tv_nsec) {
        return None;
    }
    Some(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn thread_cpu_time() -> Option<Duration> {
    None
}

/// Latency summary in microseconds.
#[derive(Debug, PartialEq)]
struct Summary {
    avg_us: f64,
    p50_us: f64,
    p99_us: f64,
    min_us: f64,
    max_us: f64,
}

/// What the client measured: the latencies and its own CPU use while recording them.
#[derive(Debug)]
struct ClientReport {
    latency: Summary,
    /// Client thread CPU time / wall time over the recorded round trips, in percent.
    cpu_pct: Option<f64>,
}

/// Nearest-rank percentile of sorted samples (q in 0..=100).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summarize(mut samples: Vec<f64>) -> Summary {
    samples.sort_by(|a, b| a.total_cmp(b));
    let avg = samples.iter().sum::<f64>() / samples.len() as f64;
    Summary {
        avg_us: avg,
        p50_us: percentile(&samples, 50.0),
        p99_us: percentile(&samples, 99.0),
        min_us: samples[0],
        max_us: samples[samples.len() - 1],
    }
}

fn client(addr: SocketAddr, o: &Options) -> Result<ClientReport, Failure> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| Failure::Runtime(format!("cannot connect to {addr}: {e}")))?;
    let mut conn = Conn::new(stream, o.mode, CLIENT_IDLE)?;
    let out: Vec<u8> = (0..o.size).map(|i| (i % 251) as u8).collect();
    let mut back = vec![0u8; o.size];
    let mut samples = Vec::with_capacity(o.iters);
    let mut recording_start: Option<(Instant, Option<Duration>)> = None;
    for i in 0..(o.warmup + o.iters) {
        if i == o.warmup {
            recording_start = Some((Instant::now(), thread_cpu_time()));
        }
        let t0 = Instant::now();
        conn.write_full(&out)?;
        if !conn.read_full(&mut back)? {
            return Err(Failure::Runtime("server closed the connection".into()));
        }
        let dt = t0.elapsed();
        if i >= o.warmup {
            samples.push(dt.as_secs_f64() * 1e6);
        }
    }
    let (cpu_end, wall_end) = (thread_cpu_time(), Instant::now());
    let cpu_pct = match recording_start {
        Some((wall0, Some(cpu0))) => cpu_end.and_then(|cpu1| {
            let wall = wall_end.duration_since(wall0).as_secs_f64();
            (wall > 0.0).then(|| 100.0 * cpu1.saturating_sub(cpu0).as_secs_f64() / wall)
        }),
        _ => None,
    };
    if back != out {
        return Err(Failure::Runtime("echoed bytes differ from the bytes sent".into()));
    }
    Ok(ClientReport { latency: summarize(samples), cpu_pct })
}

fn summary_line(o: &Options, r: &ClientReport) -> String {
    let s = &r.latency;
    let cpu = r.cpu_pct.map_or_else(|| "null".to_string(), |c| format!("{c:.1}"));
    format!(
        "{{\"size\":{},\"iters\":{},\"mode\":\"{}\",\"avg_us\":{:.3},\"p50_us\":{:.3},\"p99_us\":{:.3},\"min_us\":{:.3},\"max_us\":{:.3},\"client_cpu_pct\":{}}}",
        o.size,
        o.iters,
        o.mode.name(),
        s.avg_us,
        s.p50_us,
        s.p99_us,
        s.min_us,
        s.max_us,
        cpu
    )
}

fn run(args: &[String]) -> Result<(), Failure> {
    let (cmd, o) = parse_args(args)?;
    match cmd.as_str() {
        "server" => {
            let addr = resolve(o.addr.as_deref().ok_or_else(|| Failure::Usage("server needs --listen".into()))?)?;
            let listener = TcpListener::bind(addr).map_err(|e| Failure::Runtime(format!("cannot listen on {addr}: {e}")))?;
            let local = listener.local_addr()?;
            println!("{{\"ready\":true,\"host\":\"{}\",\"port\":{}}}", local.ip(), local.port());
            io::stdout().flush()?;
            serve(listener, o.size, o.idle_timeout, o.mode)
        }
        "client" => {
            let addr = resolve(o.addr.as_deref().ok_or_else(|| Failure::Usage("client needs --connect".into()))?)?;
            let r = client(addr, &o)?;
            println!("{}", summary_line(&o, &r));
            Ok(())
        }
        "local" => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let addr = listener.local_addr()?;
            let (size, idle, mode) = (o.size, o.idle_timeout, o.mode);
            let server = thread::spawn(move || serve(listener, size, idle, mode));
            let result = client(addr, &o);
            // The client's stream is dropped inside `client`, so the server sees EOF and returns.
            let served = server.join().map_err(|_| Failure::Runtime("server thread panicked".into()))?;
            let r = result?;
            served?;
            println!("{}", summary_line(&o, &r));
            Ok(())
        }
        other => Err(Failure::Usage(format!("unknown subcommand {other:?}"))),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(msg)) => {
            if !msg.is_empty() {
                eprintln!("mr-pingpong: {msg}");
            }
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(msg)) => {
            eprintln!("mr-pingpong: error: {msg}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let s = summarize((1..=100).map(|v| v as f64).collect());
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p99_us, 99.0);
        assert_eq!(s.min_us, 1.0);
        assert_eq!(s.max_us, 100.0);
        assert!((s.avg_us - 50.5).abs() < 1e-9);
    }

    #[test]
    fn rejects_bad_args() {
        let a = |v: &[&str]| parse_args(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(matches!(a(&["local", "--size", "0"]), Err(Failure::Usage(_))));
        assert!(matches!(a(&["local", "--size", "x"]), Err(Failure::Usage(_))));
        assert!(matches!(a(&["local", "--bogus"]), Err(Failure::Usage(_))));
        assert!(a(&["local", "--size", "4096", "--iters", "10"]).is_ok());
    }

    #[test]
    fn mode_defaults_to_block() {
        let a = |v: &[&str]| parse_args(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap().1.mode;
        assert_eq!(a(&["local"]), Mode::Block);
        assert_eq!(a(&["local", "--poll"]), Mode::Poll);
        assert_eq!(a(&["server", "--listen", "127.0.0.1:0", "--poll", "--size", "64"]), Mode::Poll);
    }

    fn local_round_trips_in(mode: Mode) -> ClientReport {
        let o = Options { size: 1024, iters: 50, warmup: 5, mode, ..Options::default() };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = thread::spawn(move || serve(listener, 1024, Duration::from_secs(5), mode));
        let r = client(addr, &o).unwrap();
        t.join().unwrap().unwrap();
        let s = &r.latency;
        assert!(s.min_us > 0.0 && s.min_us <= s.p50_us && s.p50_us <= s.p99_us && s.p99_us <= s.max_us);
        if let Some(cpu) = r.cpu_pct {
            assert!(cpu.is_finite() && cpu >= 0.0, "cpu {cpu}");
        }
        let line = summary_line(&o, &r);
        assert!(line.contains(&format!("\"mode\":\"{}\"", mode.name())), "{line}");
        assert!(line.contains("\"client_cpu_pct\":"), "{line}");
        r
    }

    #[test]
    fn local_round_trips() {
        local_round_trips_in(Mode::Block);
    }

    #[test]
    fn local_poll_round_trips() {
        local_round_trips_in(Mode::Poll);
    }

    #[test]
    fn large_messages_poll() {
        // Bigger than the socket buffers, so both ends see WouldBlock mid-message.
        let size = 4 << 20;
        let o = Options { size, iters: 3, warmup: 0, mode: Mode::Poll, ..Options::default() };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = thread::spawn(move || serve(listener, size, Duration::from_secs(5), Mode::Poll));
        client(addr, &o).unwrap();
        t.join().unwrap().unwrap();
    }

    #[test]
    fn poll_wait_is_bounded() {
        // A peer that connects and then says nothing: the polling read must give up.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let silent = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let mut conn = Conn::new(accepted, Mode::Poll, Duration::from_millis(100)).unwrap();
        let mut buf = [0u8; 16];
        let err = conn.read_full(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(silent);
    }

    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    #[test]
    fn thread_cpu_clock_advances() {
        let before = thread_cpu_time().expect("CLOCK_THREAD_CPUTIME_ID");
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        std::hint::black_box(x);
        assert!(thread_cpu_time().unwrap() > before);
    }
}
