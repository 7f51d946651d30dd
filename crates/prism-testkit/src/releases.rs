//! The releases `CHANGELOG.md` names (SPEC §15), newest first: what the version test
//! holds the manifests to, and which commit an upgrade test installs as "N-1".
//!
//! A section's heading is `## X.Y.Z` while it is being made, and `## X.Y.Z (commit
//! <sha>)` once released: the commit whose tree is that release.

use std::path::Path;

/// A version as semver's three numbers (no pre-release part is used here).
pub type Version = (u64, u64, u64);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub version: Version,
    /// The commit of the release; `None` for the section being made.
    pub commit: Option<String>,
}

impl Release {
    pub fn version_string(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }
}

pub fn parse_version(text: &str) -> Option<Version> {
    let mut parts = text.trim().split('.').map(|p| p.parse::<u64>().ok());
    let v = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(v)
}

/// The release headings of a changelog's text, in order (newest first). A heading that
/// is not `## X.Y.Z` or `## X.Y.Z (commit <sha>)` is an error naming it.
pub fn parse_changelog(text: &str) -> Result<Vec<Release>, String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(heading) = line.strip_prefix("## ") else { continue };
        let (version, commit) = match heading.split_once(" (commit ") {
            Some((v, rest)) => {
                let sha = rest.strip_suffix(')').ok_or_else(|| format!("heading {line:?}: no closing parenthesis"))?;
                if sha.len() < 7 || !sha.chars().all(|c| c.is_ascii_hexdigit()) {
                    return Err(format!("heading {line:?}: {sha:?} is not a commit"));
                }
                (v, Some(sha.to_string()))
            }
            None => (heading, None),
        };
        let version =
            parse_version(version).ok_or_else(|| format!("heading {line:?}: not `## X.Y.Z [(commit <sha>)]`"))?;
        out.push(Release { version, commit });
    }
    Ok(out)
}

/// `CHANGELOG.md` of the repository at `root`.
pub fn changelog(root: &Path) -> Vec<Release> {
    let text = std::fs::read_to_string(root.join("CHANGELOG.md")).expect("CHANGELOG.md");
    parse_changelog(&text).unwrap_or_else(|e| panic!("CHANGELOG.md: {e}"))
}

/// The newest released version older than `current`: what an upgrade to this build
/// starts from.
pub fn previous_release(releases: &[Release], current: Version) -> Option<&Release> {
    releases.iter().find(|r| r.commit.is_some() && r.version < current)
}

/// `path` (a file or folder of the repository) as it is in `commit`, written under `dir`
/// by `git archive`; returns where it is. What a test of "N-1" uses of the previous
/// release: its chart, its migrations.
pub fn checkout(commit: &str, path: &str, dir: &Path) -> std::path::PathBuf {
    use std::process::{Command, Stdio};
    std::fs::create_dir_all(dir).expect("mkdir");
    let mut git = Command::new("git")
        .args(["archive", "--format=tar", commit, path])
        .current_dir(crate::repo_root())
        .stdout(Stdio::piped())
        .spawn()
        .expect("git runs");
    let archive = git.stdout.take().expect("git's stdout");
    let untar = Command::new("tar").arg("-x").arg("-C").arg(dir).stdin(archive).status().expect("tar runs");
    let archived = git.wait().expect("git archive ends");
    assert!(archived.success() && untar.success(), "git archive {commit} {path} | tar -x -C {}", dir.display());
    dir.join(path)
}

/// The released version an upgrade to this build starts from (`CARGO_PKG_VERSION` of
/// the caller), with its commit.
pub fn previous_of(current_version: &str) -> (Release, String) {
    let current = parse_version(current_version).expect("the build's version is semver");
    let list = changelog(crate::repo_root());
    let previous = previous_release(&list, current).expect("CHANGELOG.md names a released version before this one");
    let commit = previous.commit.clone().expect("a released version names its commit");
    (previous.clone(), commit)
}

/// What is wrong with these releases for a build of `current` whose user-visible files
/// changed since the newest release as `changed_since_release` lists: the newest
/// section is the build's version; versions fall from top to bottom; a released top
/// section has no change after its commit (a change needs a new version).
pub fn problems(current: Version, releases: &[Release], changed_since_release: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let show = |v: Version| format!("{}.{}.{}", v.0, v.1, v.2);
    let Some(top) = releases.first() else {
        return vec!["CHANGELOG.md names no release".into()];
    };
    if top.version != current {
        out.push(format!(
            "the manifests say {} but CHANGELOG.md's newest section is {}",
            show(current),
            show(top.version)
        ));
    }
    for pair in releases.windows(2) {
        if pair[0].version <= pair[1].version {
            out.push(format!("CHANGELOG.md: {} is above {}, not newer", show(pair[0].version), show(pair[1].version)));
        }
    }
    if releases.iter().skip(1).any(|r| r.commit.is_none()) {
        out.push("CHANGELOG.md: only the newest section may be unreleased (no commit)".into());
    }
    if let Some(commit) = &top.commit
        && !changed_since_release.is_empty()
    {
        out.push(format!(
            "{} was released at {commit} and these changed since: {}; raise the version (Cargo.toml, the crates, \
             Chart.yaml's version and appVersion) and open its CHANGELOG.md section",
            show(top.version),
            changed_since_release.join(", ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release(v: Version, commit: Option<&str>) -> Release {
        Release { version: v, commit: commit.map(str::to_string) }
    }

    #[test]
    fn headings_parse_with_and_without_their_commit() {
        let text = "# Changelog\n\n## 0.3.0\n\ntext\n\n## 0.2.0 (commit 9966b11897a0)\n\n## 0.1.0 (commit 86c3f2f)\n";
        assert_eq!(
            parse_changelog(text),
            Ok(vec![
                release((0, 3, 0), None),
                release((0, 2, 0), Some("9966b11897a0")),
                release((0, 1, 0), Some("86c3f2f"))
            ])
        );
        assert!(parse_changelog("## next\n").is_err());
        assert!(parse_changelog("## 0.2.0 (commit xyz)\n").is_err());
    }

    #[test]
    fn a_change_after_a_release_without_a_new_version_is_a_problem() {
        let released = [release((0, 2, 0), Some("abc1234")), release((0, 1, 0), Some("def5678"))];
        assert!(problems((0, 2, 0), &released, &[]).is_empty());
        let found = problems((0, 2, 0), &released, &["charts/prism-operator/values.yaml".into()]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("raise the version"), "{found:?}");
        // The rise: a new section above, the manifests at its version.
        let risen = [release((0, 3, 0), None), released[0].clone(), released[1].clone()];
        assert!(problems((0, 3, 0), &risen, &["charts/prism-operator/values.yaml".into()]).is_empty());
    }

    #[test]
    fn manifests_and_changelog_must_agree_and_fall_in_order() {
        let risen = [release((0, 3, 0), None), release((0, 2, 0), Some("abc1234"))];
        assert_eq!(problems((0, 2, 0), &risen, &[]).len(), 1, "Cargo says 0.2.0, the changelog 0.3.0");
        let unordered = [release((0, 2, 0), None), release((0, 3, 0), Some("abc1234"))];
        assert!(!problems((0, 2, 0), &unordered, &[]).is_empty());
        let two_open = [release((0, 3, 0), None), release((0, 2, 0), None)];
        assert!(!problems((0, 3, 0), &two_open, &[]).is_empty());
    }

    #[test]
    fn the_previous_release_is_the_newest_released_below_the_build() {
        let list = [release((0, 3, 0), None), release((0, 2, 0), Some("abc1234")), release((0, 1, 0), Some("def5678"))];
        assert_eq!(previous_release(&list, (0, 3, 0)).map(|r| r.version), Some((0, 2, 0)));
        let released_top = [release((0, 3, 0), Some("0123abc")), list[1].clone()];
        assert_eq!(previous_release(&released_top, (0, 3, 0)).map(|r| r.version), Some((0, 2, 0)));
    }
}
