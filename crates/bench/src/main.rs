//! `bulkhead-bench`: bulkhead's benchmarks, a program of their own beside the product. Each
//! runs the real `bulkhead` (found beside this executable, on `PATH`, or at `$BULKHEAD_EXE`)
//! and the peers it compares with, and prints a table, or JSON with `--json`.

use std::process::ExitCode;

use bulkhead_bench::cli::BenchCmd;
use clap::{CommandFactory, Parser, Subcommand};

/// The allocator `bulkhead` runs with, so that a benchmark of write capture in this process
/// measures what a domain does (see `bulkhead_guard::heap`).
#[global_allocator]
static HEAP: bulkhead_guard::heap::Heap = bulkhead_guard::heap::Heap::new();

#[derive(Parser)]
#[command(name = "bulkhead-bench", version, about = "bulkhead's benchmarks, against its peers")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    #[command(flatten)]
    Bench(BenchCmd),
    /// Write the manual pages, generated from these definitions: `bulkhead-bench.1` and one
    /// `bulkhead-bench-BENCHMARK.1` per benchmark.
    Man {
        /// Directory to write them to (created if missing).
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Print a completion script for a shell.
    Completions {
        /// bash | zsh | fish | elvish | powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Bench(cmd) => bulkhead_bench::cli::run(cmd),
        Cmd::Man { out } => bulkhead_bench::cli::man_pages(Cli::command(), &out),
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "bulkhead-bench", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bulkhead-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}
