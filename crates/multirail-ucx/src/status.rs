//! `ucs_status_t` as a typed value, and decoding of `ucs_status_ptr_t`.

use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;

use crate::sys::ucs_status_t;

/// A UCX status code (`ucs_status_t`, values identical in 1.13 and 1.22).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub i8);

impl Status {
    pub const OK: Status = Status(0);
    pub const INPROGRESS: Status = Status(1);
    pub const ERR_NO_RESOURCE: Status = Status(-2);
    pub const ERR_IO_ERROR: Status = Status(-3);
    pub const ERR_INVALID_PARAM: Status = Status(-5);
    pub const ERR_UNREACHABLE: Status = Status(-6);
    pub const ERR_NO_ELEM: Status = Status(-12);
    pub const ERR_NO_DEVICE: Status = Status(-14);
    pub const ERR_BUSY: Status = Status(-15);
    pub const ERR_CANCELED: Status = Status(-16);
    pub const ERR_TIMED_OUT: Status = Status(-20);
    pub const ERR_UNSUPPORTED: Status = Status(-22);
    pub const ERR_NOT_CONNECTED: Status = Status(-24);
    pub const ERR_CONNECTION_RESET: Status = Status(-25);
    pub const ERR_ENDPOINT_TIMEOUT: Status = Status(-80);
    /// `UCS_ERR_LAST`: every error code is greater than this.
    pub const ERR_LAST: i8 = -100;

    /// The `UCS_*` name of the code (`UCS_ERR_LINK_FAILURE` / `UCS_ERR_ENDPOINT_FAILURE` for the
    /// codes inside those ranges).
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "UCS_OK",
            1 => "UCS_INPROGRESS",
            -1 => "UCS_ERR_NO_MESSAGE",
            -2 => "UCS_ERR_NO_RESOURCE",
            -3 => "UCS_ERR_IO_ERROR",
            -4 => "UCS_ERR_NO_MEMORY",
            -5 => "UCS_ERR_INVALID_PARAM",
            -6 => "UCS_ERR_UNREACHABLE",
            -7 => "UCS_ERR_INVALID_ADDR",
            -8 => "UCS_ERR_NOT_IMPLEMENTED",
            -9 => "UCS_ERR_MESSAGE_TRUNCATED",
            -10 => "UCS_ERR_NO_PROGRESS",
            -11 => "UCS_ERR_BUFFER_TOO_SMALL",
            -12 => "UCS_ERR_NO_ELEM",
            -13 => "UCS_ERR_SOME_CONNECTS_FAILED",
            -14 => "UCS_ERR_NO_DEVICE",
            -15 => "UCS_ERR_BUSY",
            -16 => "UCS_ERR_CANCELED",
            -17 => "UCS_ERR_SHMEM_SEGMENT",
            -18 => "UCS_ERR_ALREADY_EXISTS",
            -19 => "UCS_ERR_OUT_OF_RANGE",
            -20 => "UCS_ERR_TIMED_OUT",
            -21 => "UCS_ERR_EXCEEDS_LIMIT",
            -22 => "UCS_ERR_UNSUPPORTED",
            -23 => "UCS_ERR_REJECTED",
            -24 => "UCS_ERR_NOT_CONNECTED",
            -25 => "UCS_ERR_CONNECTION_RESET",
            -59..=-40 => "UCS_ERR_LINK_FAILURE",
            -80 => "UCS_ERR_ENDPOINT_TIMEOUT",
            -89..=-60 => "UCS_ERR_ENDPOINT_FAILURE",
            _ => "UCS_ERR_UNKNOWN",
        }
    }

    /// `UCS_OK`.
    pub fn is_ok(self) -> bool {
        self.0 == 0
    }

    /// Turns a returned status into a `Result` (`UCS_OK` → `Ok`; anything else is an error,
    /// `UCS_INPROGRESS` included: callers of immediate functions never expect it).
    pub(crate) fn check(raw: ucs_status_t) -> Result<(), Status> {
        if raw == 0 {
            Ok(())
        } else {
            Err(Status(raw))
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What a `ucs_status_ptr_t` returned by a `*_nbx` call means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PtrStatus {
    /// Completed immediately (NULL → `UCS_OK`) or failed immediately.
    Done(Result<(), Status>),
    /// A request to poll and then `ucp_request_free`.
    Pending(NonNull<c_void>),
}

/// `UCS_PTR_IS_ERR` / `UCS_PTR_IS_PTR` / `UCS_PTR_STATUS` from ucs/type/status.h.
pub(crate) fn ptr_status(p: *mut c_void) -> PtrStatus {
    let v = p as usize;
    // UCS_PTR_IS_ERR: (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST.
    if v >= (Status::ERR_LAST as isize) as usize {
        // UCS_PTR_RAW_STATUS: (ucs_status_t)(intptr_t)ptr; the range check above makes it fit.
        return PtrStatus::Done(Err(Status(v as isize as i8)));
    }
    match NonNull::new(p) {
        None => PtrStatus::Done(Ok(())),
        Some(req) => PtrStatus::Pending(req),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptr_status_decodes_null_errors_and_requests() {
        assert_eq!(ptr_status(std::ptr::null_mut()), PtrStatus::Done(Ok(())));
        let err = (-25isize) as usize as *mut c_void;
        assert_eq!(ptr_status(err), PtrStatus::Done(Err(Status::ERR_CONNECTION_RESET)));
        let last = (-100isize) as usize as *mut c_void;
        assert_eq!(ptr_status(last), PtrStatus::Done(Err(Status(-100))));
        let req = 0x1000usize as *mut c_void;
        assert!(matches!(ptr_status(req), PtrStatus::Pending(p) if p.as_ptr() == req));
        // Just below UCS_ERR_LAST is a (huge) pointer, not an error.
        let big = (-101isize) as usize as *mut c_void;
        assert!(matches!(ptr_status(big), PtrStatus::Pending(_)));
    }

    #[test]
    fn names_cover_ranges() {
        assert_eq!(Status::ERR_CONNECTION_RESET.to_string(), "UCS_ERR_CONNECTION_RESET (-25)");
        assert_eq!(Status(-45).name(), "UCS_ERR_LINK_FAILURE");
        assert_eq!(Status(-61).name(), "UCS_ERR_ENDPOINT_FAILURE");
        assert_eq!(Status::ERR_ENDPOINT_TIMEOUT.name(), "UCS_ERR_ENDPOINT_TIMEOUT");
        assert_eq!(Status(-99).name(), "UCS_ERR_UNKNOWN");
        assert!(Status::check(0).is_ok());
        assert_eq!(Status::check(-12), Err(Status::ERR_NO_ELEM));
    }
}
