//! Capturing what a UCX `*_print_info(..., FILE *stream)` function writes.

use std::ffi::c_char;

use crate::error::{Error, Result};

/// The largest capture kept (print_info output is a few KiB; this only bounds a runaway).
const MAX_CAPTURE: usize = 1 << 20;

/// Runs `f` with a `FILE*` backed by memory (`open_memstream`) and returns what it wrote.
pub(crate) fn capture(f: impl FnOnce(*mut libc::FILE)) -> Result<String> {
    let mut buf: *mut c_char = std::ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: open_memstream stores a malloc'd buffer in `buf` and its length in `size`, both
    // valid after fclose; we free the buffer below.
    let file = unsafe { libc::open_memstream(&mut buf, &mut size) };
    if file.is_null() {
        return Err(Error::Io { op: "open_memstream", source: std::io::Error::last_os_error() });
    }
    f(file);
    // SAFETY: `file` is the stream opened above, closed exactly once.
    let rc = unsafe { libc::fclose(file) };
    let text = if buf.is_null() {
        String::new()
    } else {
        // SAFETY: after fclose, `buf` holds `size` bytes written to the stream.
        let bytes = unsafe { std::slice::from_raw_parts(buf as *const u8, size.min(MAX_CAPTURE)) };
        String::from_utf8_lossy(bytes).into_owned()
    };
    // SAFETY: `buf` was allocated by open_memstream (malloc); free(NULL) is a no-op.
    unsafe { libc::free(buf.cast()) };
    if rc != 0 {
        return Err(Error::Io { op: "fclose(memstream)", source: std::io::Error::last_os_error() });
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    #[test]
    fn captures_what_is_written() {
        let text = super::capture(|f| {
            let s = b"hello\n";
            // SAFETY: `f` is a valid stream for the duration of the closure.
            unsafe { libc::fwrite(s.as_ptr().cast(), 1, s.len(), f) };
        })
        .unwrap();
        assert_eq!(text, "hello\n");
    }
}
