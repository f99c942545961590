//! Child processes that cannot outlive their test.
//!
//! Each child runs in its own process group and is killed (SIGKILL to the group) when its
//! guard drops, which also happens while a panicking test unwinds. The tests also check
//! the other direction: `no_orphans` lists processes still holding our marker.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

pub struct Child {
    name: String,
    inner: std::process::Child,
}

impl Child {
    /// Spawn `cmd` in a new process group; its output goes to `log` (or is discarded).
    pub fn spawn(name: &str, cmd: &mut Command, log: Option<&Path>) -> anyhow::Result<Child> {
        use std::os::unix::process::CommandExt;
        let (out, err) = match log {
            Some(p) => {
                let f = File::create(p)?;
                (Stdio::from(f.try_clone()?), Stdio::from(f))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let inner = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Child {
            name: name.to_string(),
            inner,
        })
    }

    pub fn pid(&self) -> u32 {
        self.inner.id()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Is it still running?
    pub fn alive(&mut self) -> bool {
        matches!(self.inner.try_wait(), Ok(None))
    }

    /// SIGTERM, then wait up to `grace` before SIGKILL. Returns the exit status code.
    pub fn terminate(&mut self, grace: Duration) -> Option<i32> {
        signal_group(self.inner.id(), libc_sig::TERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.inner.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    pub fn kill(&mut self) {
        signal_group(self.inner.id(), libc_sig::KILL);
        let _ = self.inner.kill();
        let _ = self.inner.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill();
    }
}

mod libc_sig {
    pub const TERM: i32 = libc::SIGTERM;
    pub const KILL: i32 = libc::SIGKILL;
}

fn signal_group(pid: u32, sig: i32) {
    // A negative pid signals the whole group (the child is its leader), so helpers it
    // started die with it.
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

/// Poll `f` until it returns `Some`, or give up after `limit`.
pub fn wait_until<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A free loopback TCP port (bound and released; good enough for tests on one machine).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// Path of a workspace binary built by cargo (tests run from the crate dir).
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    // Test executables live in target/<profile>/deps, binaries in target/<profile>.
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe
        .parent()
        .map(|d| d.to_path_buf())
        .unwrap_or_else(|| "target/debug".into());
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir.join(name)
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), in KiB; 0 if unreadable.
pub fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
