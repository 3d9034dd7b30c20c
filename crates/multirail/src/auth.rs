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
}
