//! Proof of possession (SPEC §5, §8): the canonical hello message, its Ed25519
//! signature, the clock window and the nonce shape. Pure: no clock, no I/O.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signature, Verifier, VerifyingKey};

pub const HELLO_DOMAIN: &str = "prism-run-hello/v1";
/// A hello's timestamp may differ from the operator's clock by at most this much.
pub const CLOCK_WINDOW_SECS: i64 = 300;

/// The six lines a Run signs, joined by `\n`, no trailing newline.
pub fn hello_message(
    server_instance_id: &str,
    component_kind: &str,
    key_generation: i64,
    timestamp: i64,
    nonce: &str,
) -> String {
    format!("{HELLO_DOMAIN}\n{server_instance_id}\n{component_kind}\n{key_generation}\n{timestamp}\n{nonce}")
}

/// 16-128 characters of `[A-Za-z0-9_-]`.
pub fn nonce_ok(nonce: &str) -> bool {
    (16..=128).contains(&nonce.len()) && nonce.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
}

/// Any i64 is the caller's to send: the difference is taken without overflow (i64::MIN
/// minus a positive `now` would panic in a debug build and wrap in a release one).
pub fn within_clock_window(timestamp: i64, now: i64) -> bool {
    timestamp.abs_diff(now) <= CLOCK_WINDOW_SECS.unsigned_abs()
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    #[error("public key is not standard base64 of 32 bytes")]
    BadPublicKey,
    #[error("signature is not standard base64 of 64 bytes")]
    MalformedSignature,
    #[error("signature does not verify")]
    BadSignature,
}

pub fn decode_public_key(b64: &str) -> Result<VerifyingKey, ProofError> {
    let bytes: [u8; 32] = STANDARD.decode(b64).ok().and_then(|b| b.try_into().ok()).ok_or(ProofError::BadPublicKey)?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| ProofError::BadPublicKey)
}

/// Verifies a standard-base64 signature of `message` by `public_key` (strict: rejects
/// weak keys and malleable signatures).
pub fn verify(public_key: &str, message: &str, signature_b64: &str) -> Result<(), ProofError> {
    let key = decode_public_key(public_key)?;
    let sig: [u8; 64] =
        STANDARD.decode(signature_b64).ok().and_then(|b| b.try_into().ok()).ok_or(ProofError::MalformedSignature)?;
    let sig = Signature::from_bytes(&sig);
    key.verify_strict(message.as_bytes(), &sig).map_err(|_| ProofError::BadSignature)?;
    // verify_strict implies verify; kept explicit for readers of the Verifier trait.
    key.verify(message.as_bytes(), &sig).map_err(|_| ProofError::BadSignature)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[7u8; 32])
    }

    #[test]
    fn message_is_six_lines_without_trailing_newline() {
        let m = hello_message("srv-eu1-7", "run", 3, 1_764_400_000, "Zk3q9-2LwX0aPq7T");
        assert_eq!(m, "prism-run-hello/v1\nsrv-eu1-7\nrun\n3\n1764400000\nZk3q9-2LwX0aPq7T");
        assert!(!m.ends_with('\n'));
    }

    #[test]
    fn a_signature_verifies_and_a_changed_byte_does_not() {
        let k = key();
        let pk = STANDARD.encode(k.verifying_key().to_bytes());
        let m = hello_message("srv", "run", 1, 10, "nonce-nonce-nonce");
        let sig = STANDARD.encode(k.sign(m.as_bytes()).to_bytes());
        assert_eq!(verify(&pk, &m, &sig), Ok(()));
        let other = hello_message("srv", "run", 2, 10, "nonce-nonce-nonce");
        assert_eq!(verify(&pk, &other, &sig), Err(ProofError::BadSignature));
        let wrong_key = STANDARD.encode(SigningKey::from_bytes(&[8u8; 32]).verifying_key().to_bytes());
        assert_eq!(verify(&wrong_key, &m, &sig), Err(ProofError::BadSignature));
        assert_eq!(verify(&pk, &m, "not base64!"), Err(ProofError::MalformedSignature));
        assert_eq!(verify(&pk, &m, &STANDARD.encode([0u8; 63])), Err(ProofError::MalformedSignature));
        assert_eq!(verify("AAAA", &m, &sig), Err(ProofError::BadPublicKey));
    }

    #[test]
    fn nonce_and_clock_rules() {
        assert!(nonce_ok("Zk3q9-2LwX0aPq7T"));
        assert!(!nonce_ok("short"));
        assert!(!nonce_ok(&"a".repeat(129)));
        assert!(!nonce_ok("has space in it!!"));
        assert!(within_clock_window(1000, 1300));
        assert!(!within_clock_window(1000, 1301));
        assert!(within_clock_window(1300, 1000));
        // The extremes a caller may send (a debug build panicked on overflow here).
        assert!(!within_clock_window(i64::MIN, 1_764_400_000));
        assert!(!within_clock_window(i64::MAX, -1));
        assert!(!within_clock_window(i64::MIN, i64::MAX));
        assert!(within_clock_window(i64::MIN, i64::MIN + 300));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn any_timestamp() -> impl Strategy<Value = i64> {
            prop_oneof![
                Just(i64::MIN),
                Just(i64::MAX),
                Just(0i64),
                any::<i64>(),
                (-1_000i64..1_000).prop_map(|d| 1_764_400_000 + d),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Any two i64: no panic (a debug build checks overflow), and the answer is the
            /// arithmetic one.
            #[test]
            fn clock_window_is_exact_for_every_integer(t in any_timestamp(), now in any_timestamp()) {
                let exact = (i128::from(t) - i128::from(now)).abs() <= i128::from(CLOCK_WINDOW_SECS);
                prop_assert_eq!(within_clock_window(t, now), exact);
            }
        }

        proptest! {
            // Ed25519 in a debug build costs milliseconds a case.
            #![proptest_config(ProptestConfig::with_cases(200))]

            /// Whatever a caller sends as key, signature and message, verification answers
            /// (never panics), and only the signer's own signature of that exact message passes.
            #[test]
            fn verification_answers_every_input(
                server in ".{0,40}", component in ".{0,20}", generation in any::<i64>(),
                t in any_timestamp(), nonce in ".{0,140}", junk_key in ".{0,60}", junk_sig in ".{0,100}",
                seed in any::<[u8; 32]>(), flip in 0usize..64,
            ) {
                let key = SigningKey::from_bytes(&seed);
                let pk = STANDARD.encode(key.verifying_key().to_bytes());
                let m = hello_message(&server, &component, generation, t, &nonce);
                let mut sig = key.sign(m.as_bytes()).to_bytes();
                prop_assert_eq!(verify(&pk, &m, &STANDARD.encode(sig)), Ok(()));
                sig[flip] ^= 1;
                prop_assert!(verify(&pk, &m, &STANDARD.encode(sig)).is_err());
                prop_assert!(verify(&junk_key, &m, &junk_sig).is_err());
                prop_assert!(verify(&pk, &m, &junk_sig).is_err());
                let _ = nonce_ok(&nonce);
            }
        }
    }
}
