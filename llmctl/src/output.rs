//! Standard output as a Unix tool writes it: when the reader goes away (`llmctl status | head -1`)
//! llmctl stops at once and quietly, with the status of a process killed by SIGPIPE (128 + 13),
//! instead of panicking in `println!`; any other write error is reported and exits 1. Every
//! line llmctl prints goes through [`out!`](crate::out) or [`out_nonl!`](crate::out_nonl).

use std::io::Write;

/// The exit status after a broken pipe, as a shell reports a process SIGPIPE killed.
pub const BROKEN_PIPE_STATUS: i32 = 128 + 13;

/// Ends llmctl after a write error on standard output (see the module doc).
pub fn write_failed(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(BROKEN_PIPE_STATUS);
    }
    eprintln!("llmctl: error: writing to standard output: {e}");
    std::process::exit(1);
}

/// Writes `args` (and a newline) to standard output, or ends llmctl.
pub fn write(args: std::fmt::Arguments<'_>, newline: bool) {
    let mut o = std::io::stdout().lock();
    let r = o.write_fmt(args).and_then(|()| if newline { o.write_all(b"\n") } else { Ok(()) });
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
