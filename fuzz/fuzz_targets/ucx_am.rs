//! Fuzz the ucx active-message decoders (`UcxAm::decode`, `decode_ucx_am_reply`). Input: one
//! byte `h` (the header length, mod 32), `h` header bytes, then the AM data. Anything that
//! decodes must carry exactly its pieces' bytes (a WRITE) or none (a READ), and re-encode to a
//! request that decodes to the same thing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use multirail_proto::codec::{decode_ucx_am_reply, UcxAm};

fuzz_target!(|data: &[u8]| {
    let Some((&h, rest)) = data.split_first() else {
        return;
    };
    let h = (h as usize % 32).min(rest.len());
    let (header, body) = rest.split_at(h);
    let _ = decode_ucx_am_reply(header);
    let Ok((am, payload)) = UcxAm::decode(header, body) else {
        return;
    };
    assert_eq!(payload.len() as u64, if am.write { am.op.total() } else { 0 });
    let (h2, mut d2) = am.encode().expect("a decoded request re-encodes");
    d2.extend_from_slice(payload);
    let (back, p2) = UcxAm::decode(&h2, &d2).expect("an encoded request decodes");
    assert_eq!(back, am);
    assert_eq!(p2, payload);
});
