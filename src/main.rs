use std::process::ExitCode;

use clap::Parser;
use prism_operator::commands::{credential, demo_run, jobs, run as run_cmd, selftest, status};
use prism_operator::config::{Cli, Command, CredentialCommand};
use prism_operator::{crd, db, telemetry};

// glibc's malloc spent about a sixth of the operator's CPU under API load (perf, MCP
// benchmark: arena lock waits, consolidation); serving many small JSON requests on few
// cores is mimalloc's case.
// A heap profile (scripts/heap-profile) builds with RUSTFLAGS="--cfg prism_heap_profile":
// heaptrack sees only the system allocator's calls.
#[cfg(not(prism_heap_profile))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    no_transparent_huge_pages();
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(operator_main()),
        Err(e) => {
            eprintln!("error: the async runtime could not start: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Turns transparent huge pages off for this process, before the runtime's threads and
/// the allocator's first arena exist. mimalloc asks the kernel for huge pages on its
/// arenas (madvise), and a 2 MiB page is resident whole as soon as one byte of it is
/// touched: at 5,000 + 5,000 a quarter of the operator's heap was huge pages, and peak
/// RSS fell from 101.2 to 85.5 MiB without them (BENCHMARKS.md). A heap of many small
/// objects gains little from them in TLB misses.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and touches no memory
        // of ours; it fails only on kernels without it (before 3.15), which lose nothing.
        let done = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        if done != 0 {
            eprintln!("note: transparent huge pages stay on (prctl: {})", std::io::Error::last_os_error());
        }
    }
}

async fn operator_main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            // One line: the first paragraph of clap's message names the bad setting (a
            // missing argument is on the lines after the first, the possible values too).
            let msg = e.to_string();
            let first: Vec<&str> = msg.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
            eprintln!("{}", if first.is_empty() { "error: invalid arguments".to_string() } else { first.join(" ") });
            return ExitCode::from(2);
        }
    };
    let _failpoints = prism_operator::failpoints::setup();
    // Before any client is built, the OTLP exporter's included.
    prism_operator::install_crypto_provider();
    // Kept to the end: dropping it sends the traces still buffered.
    let _telemetry = if matches!(cli.command, Command::Jobs(_) | Command::Selftest(_)) {
        telemetry::init_client(cli.log.log_format);
        None
    } else {
        match telemetry::init(cli.log.log_format) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("error: {e:#}");
                return ExitCode::from(2);
            }
        }
    };
    match run(cli.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Crdgen { out_dir: None } => {
            print!("{}", crd::crds_yaml()?);
        }
        Command::Crdgen { out_dir: Some(dir) } => {
            std::fs::create_dir_all(&dir)?;
            for (file, yaml) in crd::crd_files()? {
                std::fs::write(dir.join(&file), yaml)?;
                println!("wrote {}", dir.join(file).display());
            }
        }
        Command::Migrate(args) => {
            let pool = db::connect(args.url()?).await?;
            db::migrate(&pool).await?;
            println!("migrations applied");
        }
        Command::Run(args) => run_cmd::run(*args).await?,
        Command::Credential(CredentialCommand::New { key_file, generation, force }) => {
            credential::new(&key_file, generation, force)?
        }
        Command::DemoRun(args) => demo_run::run(args).await?,
        Command::Status { project_id, namespace, output, watch } => {
            status::run(&project_id, namespace, output, watch).await?
        }
        Command::Jobs(command) => jobs::run(command).await?,
        Command::Selftest(args) => selftest::run(args).await?,
    }
    Ok(())
}
