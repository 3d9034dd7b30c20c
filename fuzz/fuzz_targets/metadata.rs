//! Fuzz the metadata parsers: `AgentMeta::decode` and `DescList::decode` on the same input.
//! Anything that decodes must re-encode to bytes that decode to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use multirail_proto::{AgentMeta, DescList};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = AgentMeta::decode(data) {
        let bytes = m.encode();
        assert_eq!(
            AgentMeta::decode(&bytes).expect("encoded metadata decodes"),
            m
        );
        assert_eq!(bytes, data, "metadata encoding is canonical");
    }
    if let Ok(d) = DescList::decode(data) {
        let bytes = d.encode();
        assert_eq!(DescList::decode(&bytes).expect("encoded list decodes"), d);
        assert_eq!(bytes, data, "descriptor list encoding is canonical");
    }
});
