//! `mr-pingpong`: the raw-TCP latency baseline for `multirail bench --baseline`.
//!
//! Model: one TCP connection with `TCP_NODELAY`. The client writes an N-byte message, the
//! server reads exactly N bytes and writes them back, the client reads exactly N bytes; the
//! time of that round trip is one sample. After `--warmup` unrecorded round trips, `--iters`
//! recorded ones are summarised as one JSON line on stdout (microseconds):
//! `{"size":4096,"iters":2000,"avg_us":..,"p50_us":..,"p99_us":..,"min_us":..,"max_us":..}`.
//!
//! Subcommands:
//! * `server --listen HOST:PORT [--size N] [--idle-timeout S]`: prints
//!   `{"ready":true,"host":..,"port":..}` once listening, serves one client, then exits. It
//!   never waits longer than the idle timeout (default 30 s) for a connection or a message.
//! * `client --connect HOST:PORT [--size N] [--iters N] [--warmup N]`
//! * `local [--size N] [--iters N] [--warmup N]`: server thread on 127.0.0.1 plus client.
//!
//! Exit codes: 0 success, 1 runtime error (connect refused, timeout), 2 usage error.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

/// Parsed command line options shared by all subcommands.
#[derive(Debug, Clone)]
struct Options {
    addr: Option<String>,
    size: usize,
    iters: usize,
    warmup: usize,
    idle_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { addr: None, size: 4096, iters: 2000, warmup: 200, idle_timeout: Duration::from_secs(30) }
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

const USAGE: &str = "usage: mr-pingpong server --listen HOST:PORT [--size N] [--idle-timeout S]\n       \
mr-pingpong client --connect HOST:PORT [--size N] [--iters N] [--warmup N]\n       \
mr-pingpong local [--size N] [--iters N] [--warmup N]";

/// Largest message accepted, so a typo cannot allocate gigabytes.
const MAX_SIZE: usize = 64 << 20;

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

/// Serves one client on an already bound listener: echo `size`-byte messages until EOF.
fn serve(listener: TcpListener, size: usize, idle: Duration) -> Result<(), Failure> {
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
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(idle))?;
    let mut stream = stream;
    let mut buf = vec![0u8; size];
    loop {
        match read_full(&mut stream, &mut buf) {
            Ok(true) => stream.write_all(&buf)?,
            Ok(false) => return Ok(()), // clean EOF between messages: client is done
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reads exactly `buf.len()` bytes. Ok(false) on EOF before the first byte.
fn read_full(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let n = stream.read(&mut buf[got..])?;
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

/// Latency summary in microseconds.
#[derive(Debug, PartialEq)]
struct Summary {
    avg_us: f64,
    p50_us: f64,
    p99_us: f64,
    min_us: f64,
    max_us: f64,
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

fn client(addr: SocketAddr, o: &Options) -> Result<Summary, Failure> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| Failure::Runtime(format!("cannot connect to {addr}: {e}")))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let out: Vec<u8> = (0..o.size).map(|i| (i % 251) as u8).collect();
    let mut back = vec![0u8; o.size];
    let mut samples = Vec::with_capacity(o.iters);
    for i in 0..(o.warmup + o.iters) {
        let t0 = Instant::now();
        stream.write_all(&out)?;
        if !read_full(&mut stream, &mut back)? {
            return Err(Failure::Runtime("server closed the connection".into()));
        }
        let dt = t0.elapsed();
        if i >= o.warmup {
            samples.push(dt.as_secs_f64() * 1e6);
        }
    }
    if back != out {
        return Err(Failure::Runtime("echoed bytes differ from the bytes sent".into()));
    }
    Ok(summarize(samples))
}

fn print_summary(o: &Options, s: &Summary) {
    println!(
        "{{\"size\":{},\"iters\":{},\"avg_us\":{:.3},\"p50_us\":{:.3},\"p99_us\":{:.3},\"min_us\":{:.3},\"max_us\":{:.3}}}",
        o.size, o.iters, s.avg_us, s.p50_us, s.p99_us, s.min_us, s.max_us
    );
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
            serve(listener, o.size, o.idle_timeout)
        }
        "client" => {
            let addr = resolve(o.addr.as_deref().ok_or_else(|| Failure::Usage("client needs --connect".into()))?)?;
            let s = client(addr, &o)?;
            print_summary(&o, &s);
            Ok(())
        }
        "local" => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let addr = listener.local_addr()?;
            let (size, idle) = (o.size, o.idle_timeout);
            let server = thread::spawn(move || serve(listener, size, idle));
            let result = client(addr, &o);
            // The client's stream is dropped inside `client`, so the server sees EOF and returns.
            let served = server.join().map_err(|_| Failure::Runtime("server thread panicked".into()))?;
            let s = result?;
            served?;
            print_summary(&o, &s);
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
    fn local_round_trips() {
        let o = Options { size: 1024, iters: 50, warmup: 5, ..Options::default() };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = thread::spawn(move || serve(listener, 1024, Duration::from_secs(5)));
        let s = client(addr, &o).unwrap();
        t.join().unwrap().unwrap();
        assert!(s.min_us > 0.0 && s.min_us <= s.p50_us && s.p50_us <= s.p99_us && s.p99_us <= s.max_us);
    }
}
