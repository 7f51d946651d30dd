//! `prism-operator credential new`: an Ed25519 key pair for a Run.

use std::io::Write;
use std::path::Path;

use crate::run_client;

/// Writes the private key with mode 0600 (created that way, never widened) and prints the
/// `spec.credential` block.
pub fn new(key_file: &Path, generation: i64, force: bool) -> anyhow::Result<()> {
    let (key, public) = run_client::new_key()?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true);
    if force {
        opts.create(true).truncate(true);
    } else {
        opts.create_new(true);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut file = opts.open(key_file).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => {
            anyhow::anyhow!("{} exists; use --force to replace it", key_file.display())
        }
        _ => anyhow::anyhow!("cannot write {}: {e}", key_file.display()),
    })?;
    file.write_all(run_client::key_to_file_text(&key).as_bytes())?;
    eprintln!("private key written to {} (mode 0600); keep it on the Run's machine only", key_file.display());
    println!("credential:\n  publicKey: {public}\n  generation: {generation}");
    Ok(())
}
