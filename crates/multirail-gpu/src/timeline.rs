//! Per-stage timelines and the breakdown the bench prints: time per chunk and % busy of the
//! D2H copy, the wire and the H2D copy, and which of them is the bottleneck.
//!
//! Pure bookkeeping over intervals (times are offsets from the transfer's start, virtual in the
//! simulator, measured in the executor), so both report the same way and tests can assert on
//! overlap instead of on wall-clock ratios.

use std::time::Duration;

use crate::staging::ChunkId;

/// A hardware stage of the staged path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    D2H,
    Wire,
    H2D,
}

impl Stage {
    pub const ALL: [Stage; 3] = [Stage::D2H, Stage::Wire, Stage::H2D];

    fn index(self) -> usize {
        self as usize
    }
}

/// One operation of one stage: busy from `start` to `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub stage: Stage,
    pub chunk: ChunkId,
    pub bytes: u64,
    pub start: Duration,
    pub end: Duration,
}

/// Intervals of every stage of one transfer (or of several, back to back).
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    intervals: Vec<Interval>,
}

/// One stage's share of a transfer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageReport {
    pub stage: Stage,
    pub ops: u64,
    pub bytes: u64,
    /// Time the stage had at least one operation running (union of its intervals).
    pub busy: Duration,
    /// `busy` over the transfer's span, 0..=1.
    pub busy_frac: f64,
    /// Mean time of one operation.
    pub per_chunk: Duration,
}

/// The per-stage breakdown of a timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Breakdown {
    /// First start to last end.
    pub span: Duration,
    pub stages: [StageReport; 3],
    /// The stage with the most busy time: the one to speed up.
    pub bottleneck: Stage,
}

impl Breakdown {
    pub fn stage(&self, s: Stage) -> &StageReport {
        &self.stages[s.index()]
    }
}

impl Timeline {
    pub fn new() -> Self {
        Timeline::default()
    }

    pub fn record(&mut self, iv: Interval) {
        self.intervals.push(iv);
    }

    pub fn extend(&mut self, ivs: impl IntoIterator<Item = Interval>) {
        self.intervals.extend(ivs);
    }

    pub fn intervals(&self) -> &[Interval] {
        &self.intervals
    }

    /// First start to last end (zero when empty).
    pub fn span(&self) -> Duration {
        let start = self.intervals.iter().map(|i| i.start).min().unwrap_or_default();
        let end = self.intervals.iter().map(|i| i.end).max().unwrap_or_default();
        end.saturating_sub(start)
    }

    /// Merged busy periods of one stage, sorted.
    pub fn busy_periods(&self, stage: Stage) -> Vec<(Duration, Duration)> {
        let mut v: Vec<(Duration, Duration)> = self.intervals.iter().filter(|i| i.stage == stage).map(|i| (i.start, i.end)).collect();
        v.sort();
        let mut out: Vec<(Duration, Duration)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        out
    }

    /// Time the stage was busy.
    pub fn busy(&self, stage: Stage) -> Duration {
        self.busy_periods(stage).iter().map(|(s, e)| *e - *s).sum()
    }

    /// Time during which both stages were busy at once: the overlap the pipeline buys.
    pub fn overlap(&self, a: Stage, b: Stage) -> Duration {
        let (pa, pb) = (self.busy_periods(a), self.busy_periods(b));
        let (mut i, mut j, mut total) = (0, 0, Duration::ZERO);
        while i < pa.len() && j < pb.len() {
            let lo = pa[i].0.max(pb[j].0);
            let hi = pa[i].1.min(pb[j].1);
            if hi > lo {
                total += hi - lo;
            }
            if pa[i].1 < pb[j].1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        total
    }

    /// Time during which all three stages were busy at once.
    pub fn overlap_all(&self) -> Duration {
        let mut t = Timeline::new();
        for (s, e) in intersect(&self.busy_periods(Stage::D2H), &self.busy_periods(Stage::Wire)) {
            t.record(Interval { stage: Stage::D2H, chunk: ChunkId(0), bytes: 0, start: s, end: e });
        }
        for (s, e) in self.busy_periods(Stage::H2D) {
            t.record(Interval { stage: Stage::H2D, chunk: ChunkId(0), bytes: 0, start: s, end: e });
        }
        t.overlap(Stage::D2H, Stage::H2D)
    }

    pub fn breakdown(&self) -> Breakdown {
        let span = self.span();
        let stages = Stage::ALL.map(|stage| {
            let ops: Vec<&Interval> = self.intervals.iter().filter(|i| i.stage == stage).collect();
            let busy = self.busy(stage);
            let total: Duration = ops.iter().map(|i| i.end - i.start).sum();
            StageReport {
                stage,
                ops: ops.len() as u64,
                bytes: ops.iter().map(|i| i.bytes).sum(),
                busy,
                busy_frac: if span.is_zero() { 0.0 } else { busy.as_secs_f64() / span.as_secs_f64() },
                per_chunk: if ops.is_empty() { Duration::ZERO } else { total / ops.len() as u32 },
            }
        });
        let bottleneck = stages.iter().max_by_key(|r| r.busy).map_or(Stage::Wire, |r| r.stage);
        Breakdown { span, stages, bottleneck }
    }
}

fn intersect(a: &[(Duration, Duration)], b: &[(Duration, Duration)]) -> Vec<(Duration, Duration)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            out.push((lo, hi));
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

impl std::fmt::Display for Breakdown {
    /// One line per stage, as the bench prints it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "span {:?}, bottleneck {:?}", self.span, self.bottleneck)?;
        for r in &self.stages {
            writeln!(
                f,
                "  {:>4?}: {:>4} ops {:>12} B  {:>10.1?}/chunk  {:>5.1}% busy",
                r.stage,
                r.ops,
                r.bytes,
                r.per_chunk,
                r.busy_frac * 100.0
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(stage: Stage, s: u64, e: u64) -> Interval {
        Interval { stage, chunk: ChunkId(0), bytes: 1, start: Duration::from_millis(s), end: Duration::from_millis(e) }
    }

    #[test]
    fn busy_and_overlap_merge_intervals() {
        let mut t = Timeline::new();
        t.extend([iv(Stage::D2H, 0, 10), iv(Stage::D2H, 5, 20), iv(Stage::Wire, 10, 30), iv(Stage::H2D, 15, 40)]);
        assert_eq!(t.busy(Stage::D2H), Duration::from_millis(20));
        assert_eq!(t.overlap(Stage::D2H, Stage::Wire), Duration::from_millis(10));
        assert_eq!(t.overlap_all(), Duration::from_millis(5));
        let b = t.breakdown();
        assert_eq!(b.span, Duration::from_millis(40));
        assert_eq!(b.bottleneck, Stage::H2D);
        assert!((b.stage(Stage::Wire).busy_frac - 0.5).abs() < 1e-9);
        assert_eq!(b.stage(Stage::D2H).per_chunk, Duration::from_micros(12500));
        assert!(b.to_string().contains("bottleneck H2D"));
    }
}
