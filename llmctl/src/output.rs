//! Standard output as a Unix tool writes it, and only llmctl's own words on it.
//!
//! **Libraries never write on the reply stream.** Qualcomm's QNN libraries (and any other C
//! library llmctl loads) print diagnostics on file descriptor 1 (`# LIBNATIVE: …`, `<E> unexpected
//! GraphHtpSettings option 66`); in `llmctl run` that text would land inside the model's reply, or
//! inside a `--json` document. [`isolate`], called first thing in `main`, keeps standard output
//! for llmctl alone: it duplicates descriptor 1 as llmctl's reply stream (close-on-exec) and points
//! descriptor 1 at standard error, so whatever a library prints reaches the terminal's diagnostics,
//! never a reply. Every line llmctl prints goes through [`out!`](crate::out),
//! [`out_nonl!`](crate::out_nonl) or [`stdout`].
//!
//! When the reader goes away (`llmctl status | head -1`) llmctl stops at once and quietly, with
//! the status of a process killed by SIGPIPE (128 + 13), instead of panicking; any other write
//! error is reported and exits 1.

use std::fs::File;
use std::io::{LineWriter, Write};
use std::sync::{Mutex, OnceLock};

/// The exit status after a broken pipe, as a shell reports a process SIGPIPE killed.
pub const BROKEN_PIPE_STATUS: i32 = 128 + 13;

/// llmctl's reply stream once [`isolate`] has run: the original standard output, and whether
/// it is a terminal (asked once: the stream's lock is not reentrant, and a caller holding it
/// asks).
static REPLY: OnceLock<(Mutex<LineWriter<File>>, bool)> = OnceLock::new();

/// Keeps standard output for llmctl's own words (see the module doc). Call once, before any
/// library is loaded; a failure leaves descriptor 1 as it was (and says why on standard error).
pub fn isolate() {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    let done = (|| -> nix::Result<File> {
        let reply = nix::unistd::dup(std::io::stdout())?;
        fcntl(&reply, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
        nix::unistd::dup2_stdout(std::io::stderr())?;
        Ok(File::from(reply))
    })();
    match done {
        Ok(f) => {
            let terminal = std::io::IsTerminal::is_terminal(&f);
            let _ = REPLY.set((Mutex::new(LineWriter::new(f)), terminal));
        }
        Err(e) => eprintln!("llmctl: warning: standard output is shared with libraries: {e}"),
    }
}

/// Ends llmctl after a write error on standard output (see the module doc).
pub fn write_failed(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(BROKEN_PIPE_STATUS);
    }
    eprintln!("llmctl: error: writing to standard output: {e}");
    std::process::exit(1);
}

/// llmctl's standard output: the reply stream after [`isolate`], else descriptor 1. It holds no
/// lock between calls (each write takes the stream's lock for itself), so code that holds one
/// may also call [`out!`](crate::out).
pub struct Stdout(());

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match REPLY.get() {
            Some((m, _)) => m.lock().unwrap_or_else(|e| e.into_inner()).write(buf),
            None => std::io::stdout().write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match REPLY.get() {
            Some((m, _)) => m.lock().unwrap_or_else(|e| e.into_inner()).write_all(buf),
            None => std::io::stdout().write_all(buf),
        }
    }

    fn write_fmt(&mut self, args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
        match REPLY.get() {
            Some((m, _)) => m.lock().unwrap_or_else(|e| e.into_inner()).write_fmt(args),
            None => std::io::stdout().write_fmt(args),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match REPLY.get() {
            Some((m, _)) => m.lock().unwrap_or_else(|e| e.into_inner()).flush(),
            None => std::io::stdout().flush(),
        }
    }
}

/// llmctl's standard output (see [`Stdout`]).
pub fn stdout() -> Stdout {
    Stdout(())
}

/// Whether llmctl's standard output is a terminal (callable while holding [`stdout`]).
pub fn is_terminal() -> bool {
    match REPLY.get() {
        Some((_, terminal)) => *terminal,
        None => std::io::IsTerminal::is_terminal(&std::io::stdout()),
    }
}

/// Writes `args` (and a newline) to standard output, or ends llmctl.
pub fn write(args: std::fmt::Arguments<'_>, newline: bool) {
    let r = match REPLY.get() {
        Some((m, _)) => {
            let mut o = m.lock().unwrap_or_else(|e| e.into_inner());
            o.write_fmt(args).and_then(|()| if newline { o.write_all(b"\n") } else { Ok(()) })
        }
        None => {
            let mut o = std::io::stdout().lock();
            o.write_fmt(args).and_then(|()| if newline { o.write_all(b"\n") } else { Ok(()) })
        }
    };
    if let Err(e) = r {
        write_failed(&e);
    }
}

/// `println!` that ends llmctl quietly when standard output's reader is gone.
#[macro_export]
macro_rules! out {
    () => {
        $crate::output::write(format_args!(""), true)
    };
    ($($t:tt)*) => {
        $crate::output::write(format_args!($($t)*), true)
    };
}

/// `print!` that ends llmctl quietly when standard output's reader is gone.
#[macro_export]
macro_rules! out_nonl {
    ($($t:tt)*) => {
        $crate::output::write(format_args!($($t)*), false)
    };
}

/// A Binder transport error in words (an errno as the OS says it: "Connection refused").
pub fn status_words(e: &rsbinder::StatusCode) -> String {
    use rsbinder::StatusCode as S;
    match e {
        S::Errno(n) if *n < 0 => std::io::Error::from_raw_os_error(-n).to_string(),
        S::NameNotFound => "not found".into(),
        S::PermissionDenied => "permission denied".into(),
        S::DeadObject => "the daemon is gone".into(),
        S::NoMemory => "out of memory".into(),
        S::FailedTransaction => "the transaction failed".into(),
        other => other.to_string(),
    }
}
