//! `prism-operator credential new`: an Ed25519 key pair for a Run.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::run_client;

/// Writes the private key with mode 0600 and prints the `spec.credential` block.
pub fn new(key_file: &Path, generation: i64, force: bool) -> anyhow::Result<()> {
    let (key, public) = run_client::new_key()?;
    write_key(key_file, run_client::key_to_file_text(&key).as_bytes(), force)?;
    eprintln!("private key written to {} (mode 0600); keep it on the Run's machine only", key_file.display());
    println!("credential:\n  publicKey: {public}\n  generation: {generation}");
    Ok(())
}

/// A new file of mode 0600 holding `text`, created as such (never widened afterwards).
/// Without `force` an existing path is refused. With it, the key goes to a new file
/// beside the old one, which is then renamed over it: whatever was there (a file of
/// another mode, a symlink to somewhere else) is replaced, never written through, so the
/// key never lands in a file that others can read or that the link points at.
fn write_key(key_file: &Path, text: &[u8], force: bool) -> anyhow::Result<()> {
    if !force {
        return create_private(key_file, text).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                anyhow::anyhow!("{} exists; use --force to replace it", key_file.display())
            }
            _ => anyhow::anyhow!("cannot write {}: {e}", key_file.display()),
        });
    }
    let temporary = beside(key_file);
    create_private(&temporary, text).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", temporary.display()))?;
    std::fs::rename(&temporary, key_file).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        anyhow::anyhow!("cannot replace {}: {e}", key_file.display())
    })
}

/// A fresh name in the same directory (a rename is atomic only within one file system).
fn beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "run.key".into());
    path.with_file_name(format!(".{name}.{}.tmp", uuid::Uuid::new_v4().simple()))
}

fn create_private(path: &Path, text: &[u8]) -> std::io::Result<()> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut file = opts.open(path)?;
    file.write_all(text)?;
    file.sync_all()
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("prism-cred-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).expect("metadata").permissions().mode() & 0o777
    }

    #[test]
    fn force_replaces_a_readable_file_with_a_private_one() {
        let d = dir();
        let key = d.join("run.key");
        std::fs::write(&key, "old").expect("write");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(write_key(&key, b"new", false).is_err(), "no --force: refused");
        assert_eq!(std::fs::read_to_string(&key).expect("read"), "old");
        write_key(&key, b"new", true).expect("force");
        assert_eq!((std::fs::read_to_string(&key).expect("read").as_str(), mode(&key)), ("new", 0o600));
        assert_eq!(std::fs::read_dir(&d).expect("ls").count(), 1, "no temporary file left behind");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn force_replaces_a_symlink_instead_of_writing_through_it() {
        let d = dir();
        let target = d.join("elsewhere");
        std::fs::write(&target, "not yours").expect("write");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let key = d.join("run.key");
        std::os::unix::fs::symlink(&target, &key).expect("symlink");
        write_key(&key, b"secret", true).expect("force");
        assert_eq!(std::fs::read_to_string(&target).expect("read"), "not yours", "the link's target is untouched");
        assert!(!std::fs::symlink_metadata(&key).expect("metadata").file_type().is_symlink());
        assert_eq!((std::fs::read_to_string(&key).expect("read").as_str(), mode(&key)), ("secret", 0o600));
        let _ = std::fs::remove_dir_all(&d);
    }
}
