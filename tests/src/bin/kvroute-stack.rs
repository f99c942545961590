//! `kvroute-stack`: operator and developer entry points of the test harness.
//! `render-envoy` prints the shipped Envoy configuration (envoy/envoy.yaml).

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvroute-stack", about = "Run and render the kvroute stack")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the shipped Envoy configuration (what envoy/envoy.yaml holds).
    RenderEnvoy,
}

fn main() {
    match Cli::parse().cmd {
        Cmd::RenderEnvoy => print!("{}", kvroute_tests::envoy::EnvoyLayout::shipped().render()),
    }
}
