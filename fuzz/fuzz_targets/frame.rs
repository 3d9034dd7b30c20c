//! Fuzz the frame decoder: `Header::decode` on the first 16 bytes, then `Body::decode` for the
//! kind it names on the rest. Anything that decodes must re-encode to a frame that decodes to
//! the same header fields and body (and re-encoding that is byte-stable).
#![no_main]

use libfuzzer_sys::fuzz_target;
use multirail_proto::codec::HEADER_LEN;
use multirail_proto::{Body, Header};

fuzz_target!(|data: &[u8]| {
    let Some((head, body)) = data.split_first_chunk::<HEADER_LEN>() else {
        return;
    };
    let Ok(h) = Header::decode(head) else {
        return;
    };
    // The decoder must refuse a body over the header's bound on its own, too.
    let Ok(b) = Body::decode(h.kind, body) else {
        return;
    };
    assert_eq!(b.kind(), h.kind);
    let bytes = b.encode(h.req_id);
    let h2 = Header::decode(bytes[..HEADER_LEN].try_into().expect("16 bytes"))
        .expect("an encoded header decodes");
    assert_eq!(h2.kind, h.kind);
    assert_eq!(h2.req_id, h.req_id);
    assert_eq!(h2.body_len as usize, bytes.len() - HEADER_LEN);
    let b2 = Body::decode(h2.kind, &bytes[HEADER_LEN..]).expect("an encoded body decodes");
    assert_eq!(b2, b);
    assert_eq!(b2.encode(h.req_id), bytes, "encoding is canonical");
});
