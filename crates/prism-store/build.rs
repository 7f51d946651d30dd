// `sqlx::migrate!` embeds the repository's migrations/ at compile time, but cargo does not
// know the directory is an input: without this, a migration added with no change to a
// .rs file leaves every binary running the old set.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
