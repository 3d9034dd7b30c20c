//! Shared-secret challenge-response for the side channel and data connections.
//!
//! Both sides contribute a random 16-byte nonce; each proves knowledge of the secret with an
//! HMAC-SHA256 over both nonces, its role and its name, so a proof cannot be replayed on
//! another connection or reflected back. See docs/SECURITY.md.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], label: &[u8], first: &[u8; 16], second: &[u8; 16], name: &str) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(first);
    m.update(second);
    m.update(name.as_bytes());
    m.finalize().into_bytes().into()
}

/// The client's proof (sent in `Auth`).
pub fn client_proof(secret: &[u8], server_nonce: &[u8; 16], client_nonce: &[u8; 16], client_name: &str) -> [u8; 32] {
    mac(secret, b"multirail-auth-v1 client", server_nonce, client_nonce, client_name)
}

/// The server's proof (sent in `Welcome`).
pub fn server_proof(secret: &[u8], client_nonce: &[u8; 16], server_nonce: &[u8; 16], server_name: &str) -> [u8; 32] {
    mac(secret, b"multirail-auth-v1 server", client_nonce, server_nonce, server_name)
}

/// The key of one connection's session (a UCX session's `UcxOpen`/`UcxReady` MACs and its
/// active-message secret): HMAC-SHA256 over both handshake nonces, so only the two ends of
/// this connection (holders of the secret that saw both nonces) know it, and it differs per
/// connection.
pub fn session_key(secret: &[u8], client_nonce: &[u8; 16], server_nonce: &[u8; 16]) -> [u8; 32] {
    mac(secret, b"multirail-session-v1", client_nonce, server_nonce, "")
}

/// The MAC of a session message: `label` (what it is), `seq` (its place in the session: a
/// message cannot be replayed in another place) and its bytes.
pub fn session_mac(key: &[u8; 32], label: &[u8], seq: u64, bytes: &[u8]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(&seq.to_le_bytes());
    m.update(bytes);
    m.finalize().into_bytes().into()
}

/// A session's 16-byte active-message secret (carried in every UCX active message of the
/// session, both ways), derived from its key: it never crosses the TCP connection.
pub fn am_secret(key: &[u8; 32]) -> [u8; 16] {
    session_mac(key, b"multirail-ucx-am-v1", 0, &[])[..16].try_into().expect("16 bytes")
}

/// Constant-time equality of two byte strings of the same length (false when they differ in
/// length).
pub fn bytes_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Constant-time equality of two proofs.
pub fn proofs_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_role_nonces_and_name() {
        let (s, cn, sn) = (b"secret".as_slice(), [1u8; 16], [2u8; 16]);
        let c = client_proof(s, &sn, &cn, "a");
        assert!(proofs_equal(&c, &client_proof(s, &sn, &cn, "a")));
        assert!(!proofs_equal(&c, &client_proof(b"other", &sn, &cn, "a")));
        assert!(!proofs_equal(&c, &client_proof(s, &cn, &sn, "a")));
        assert!(!proofs_equal(&c, &client_proof(s, &sn, &cn, "b")));
        assert!(!proofs_equal(&c, &server_proof(s, &cn, &sn, "a")), "a client proof is not a server proof");
    }

    #[test]
    fn session_keys_bind_secret_and_both_nonces() {
        let k = session_key(b"s", &[1; 16], &[2; 16]);
        assert_ne!(k, session_key(b"t", &[1; 16], &[2; 16]));
        assert_ne!(k, session_key(b"s", &[2; 16], &[1; 16]));
        assert_ne!(session_mac(&k, b"a", 0, b"x"), session_mac(&k, b"a", 1, b"x"), "the place is bound");
        assert_ne!(session_mac(&k, b"a", 0, b"x"), session_mac(&k, b"b", 0, b"x"), "the label is bound");
        assert_ne!(am_secret(&k), am_secret(&session_key(b"s", &[1; 16], &[3; 16])));
        assert!(bytes_equal(b"ab", b"ab") && !bytes_equal(b"ab", b"ac") && !bytes_equal(b"ab", b"abc"));
    }
}
